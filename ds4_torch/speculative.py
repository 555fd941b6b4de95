"""Speculative decoding with the model's own MTP layer (DeepSeek-V4's multi-token prediction).

Each step verifies N drafted tokens in one forward of the main model over 1 + N tokens per
sequence: the pending token (sampled, not yet in the cache) and the N drafts. The drafts come
from the MTP layer (`DS4ForCausalLM.mtp_forward`): the first from the previous step's MTP pass,
the others from one-token MTP passes fed back the layer's own output. Tokens are chosen by
`BatchSampler` with noise that depends only on (seed, position): the drafts with the noise of
the positions they draft, the 1 + N verified positions with their own, all in one call. A draft
is accepted exactly when it equals the token the main model samples at its position (greedy: its
argmax), and the first mismatch is replaced by that token (the bonus token when all N match). So
the tokens are the ones plain decoding with the same sampler gives, whatever the drafts:
speculation changes only how many forwards it takes.

Every shape in a step is fixed by N (and the batch): the verify forward is always 1 + N tokens,
the MTP layer catches up on 1 + N positions, and the drafts past the first are one-token passes.
Rejected tokens are taken back in place with `cache.Rollback` (the forwards record what they
overwrite: ring rows, the compressor and indexer frontiers at every candidate end, rows a token
may close): no whole-state copy, no re-feeding of accepted tokens, and, per sequence of a
batch, its own acceptance from a tensor. The one host read of a step is the emitted tokens
(the caller needs them); positions, acceptance and the rollback stay on the device. Over a
`paged.PagedDS4Cache` the verify forward takes its tokens tentatively (only the shape is read)
and the block tables are settled from that host read (`drop_tokens` / `name_tokens`); a `trim`
drops before its rollback.

The MTP layer's cache (`cache.mtp`, its own positions) only ever keeps positions fed with the
main model's hidden streams and true tokens: its one-token drafting passes are rolled back the
same way, and its catch-up pass over the verified positions keeps the accepted ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import DS4Cache, Rollback
from .decode import align_mtp, make_forwards, prefill, synchronize
from .faults import fault_point
from .sampling import BatchSampler

MAX_DRAFT_TOKENS = 3


@dataclass
class SpeculationStats:
    steps: int = 0       # verify forwards
    drafted: int = 0     # draft tokens proposed
    accepted: int = 0    # draft tokens accepted
    emitted: int = 0     # tokens emitted by verify steps (accepted drafts + one sampled token each)

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verify step, the bonus token included."""
        return self.emitted / self.steps if self.steps else 0.0


def check_draft_tokens(model, n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_DRAFT_TOKENS:
        raise ValueError(f"speculative_tokens must be an integer in [0, {MAX_DRAFT_TOKENS}], got {n!r}")
    if n and getattr(model, "mtp", None) is None:
        raise ValueError("speculative decoding needs a model with an MTP layer (num_nextn_predict_layers >= 1 "
                         "and mtp.* weights in the checkpoint)")


def rejection_sample(target: torch.Tensor, draft: torch.Tensor, drafts: torch.Tensor,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Standard speculative rejection sampling (Leviathan et al., Chen et al.): `target` [n+1, V]
    the main model's probabilities at the n drafted positions and the one after, `draft` [n, V]
    the probabilities the drafts [n] were sampled from. Draft i is accepted with probability
    min(1, p_i(d_i) / q_i(d_i)) while all before it were; the first rejected one is replaced by a
    draw from max(0, p_i - q_i) renormalised, or, when all are accepted, a bonus token is drawn
    from p_n. Returns the emitted tokens [accepted + 1]: distributed exactly as sampling from the
    target one token at a time."""
    n = drafts.shape[0]
    p = target[:n].gather(-1, drafts.view(-1, 1)).squeeze(-1)
    q = draft.gather(-1, drafts.view(-1, 1)).squeeze(-1)
    u = torch.rand(n, generator=generator, device=target.device)
    accepted = int((u * q <= p).long().cumprod(0).sum())
    if accepted < n:
        residual = (target[accepted] - draft[accepted]).clamp(min=0)
        if not bool(residual.sum() > 0):  # p == q: the rejection had probability 0
            residual = target[accepted]
    else:
        residual = target[n]
    last = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return torch.cat([drafts[:accepted], last])


class Speculator:
    """Speculative decoding of the first B sequences of `cache` (row b with `sampler` slot b).

        spec = Speculator(model, cache, sampler, draft_tokens=N)
        first = spec.start(prompt_ids, chunk)       # prefill; the first token (batch 1)
        tokens, logits = spec.step(limit)          # 1 .. N+1 tokens, and the logits they came from

        spec = Speculator(model, cache, sampler, N, batch=B)
        firsts, logits = spec.start_batch(prompts, chunk)   # B prompts of any lengths
        tokens, rows = spec.step_batch(limits)     # per sequence: its tokens, their logits

    `limit`: the most tokens this step may emit (drafts are cut to fit it and the cache; in a
    batch every sequence drafts the same N, and `limits` caps what each one keeps).

    Continuous batching (a server): `step_batch` runs the first len(limits) rows (the others
    stand); a row joins with `start_row` (prefilled here) or `join_row` (its slot filled by the
    caller, e.g. copied from a session), moves with `move_row`, and a row whose request stopped
    inside a step's tokens gives the rest back with `trim`.

    `acceptance`: "match" (the default, see the module docstring: the tokens of plain decoding
    with the same sampler) or "rejection": drafts drawn from the MTP layer's distribution and
    accepted by `rejection_sample` with `generator`, the textbook algorithm, row by row, for
    samplers whose noise is not a function of the position (the same distribution, other tokens).
    Its rows start together (`start_batch`) and every step runs them all.

    `mode`: how the three forwards of a step run: "eager", or "graph" / "compile" (see
    `ds4_torch.decode`): one captured or compiled function per fixed shape; a step over r rows
    then runs the next power-of-two width of rows (the rows past r idle: they keep nothing)."""

    def __init__(self, model, cache: DS4Cache, sampler: BatchSampler, draft_tokens: int,
                 stats: SpeculationStats | None = None, acceptance: str = "match",
                 generator: torch.Generator | None = None, batch: int = 1, mode: str = "eager"):
        check_draft_tokens(model, draft_tokens)
        if acceptance not in ("match", "rejection"):
            raise ValueError(f"acceptance must be 'match' or 'rejection', got {acceptance!r}")
        if cache.mtp is None:
            raise ValueError("the cache has no MTP layer state: make it with the MTP model's new_cache()")
        if not 1 <= batch <= cache.batch_size:
            raise ValueError(f"batch must be in [1, {cache.batch_size}], got {batch}")
        self.acceptance, self.generator = acceptance, generator
        self.model, self.cache, self.sampler, self.n, self.B = model, cache.narrow(batch), sampler, draft_tokens, batch
        self.stats = stats if stats is not None else SpeculationStats()
        self.device = cache.device
        self.slots = list(range(batch))
        self.slot_index = torch.arange(batch, device=self.device)
        self.mode = mode
        self._forwards: dict[int, object] = {}
        self.forwards = self.forwards_for(batch)  # eager, captured or compiled
        # Captures and compiles trace under no_grad; eager steps skip autograd's bookkeeping entirely.
        self.grad_off = torch.inference_mode if self.forwards.mode == "eager" else torch.no_grad
        # Every row's state: the pending token (sampled, not in the cache yet), the first draft of
        # its next step and the MTP layer's output it came from (written in place, row by row).
        H, hc = model.config.hidden_size, model.config.hc_mult
        self.pending = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.draft = torch.zeros_like(self.pending)
        self.mtp_out = torch.zeros(batch, 1, hc, H, dtype=model.dtype, device=self.device)
        self.positions = [0] * batch  # host copies, moved by what steps emit
        self.last = None  # what finish() and trim() need of the last step
        self.last_sample = None  # the last step's verified rows as the sampler gave them (detailed steps)
        self.draft_probs: list[torch.Tensor] = []  # "rejection": the distributions [B, V] the drafts came from

    def forwards_for(self, rows: int):
        """The forwards a step over `rows` rows runs: eager ones over exactly those rows, captured
        or compiled ones over the next power of two (fixed shapes), at most the batch."""
        width = rows
        if self._forwards.get(self.B) is not None and self._forwards[self.B].mode != "eager":
            width = min(self.B, 1 << (rows - 1).bit_length())
        if width not in self._forwards:
            self._forwards[width] = make_forwards(self.model, self.cache.narrow(width), self.mode)
        return self._forwards[width]

    def reset(self) -> None:
        """Forget every captured or compiled step and every row's state (after a failed step: the
        caller resets the cache)."""
        self._forwards.clear()
        self.forwards = self.forwards_for(self.B)
        self.pending.zero_()
        self.draft.zero_()
        self.mtp_out.zero_()
        self.positions = [0] * self.B
        self.last = self.last_sample = None
        self.draft_probs = []

    # ------------------------------------------------------------------ start
    def start(self, prompt_ids: torch.Tensor, chunk: int) -> tuple[int, torch.Tensor]:
        """Prefill `prompt_ids` [1, T] (batch 1); the first token and its logits [V]."""
        tokens, logits = self.start_batch([prompt_ids.view(-1).tolist()], chunk)
        return tokens[0], logits[0]

    def start_batch(self, prompts, chunk: int) -> tuple[list[int], torch.Tensor]:
        """Prefill each sequence's prompt (main and MTP layers; lengths may differ) after what its
        cache slot already holds; the first tokens and their logits [B, V]. The MTP state is moved
        to where the main layers stand (`decode.align_mtp`): a lagging one skips the positions it
        lacks, one ahead starts blank. Either only costs drafts: the output is the same, and the
        MTP positions never run ahead."""
        if len(prompts) != self.B:
            raise ValueError(f"start_batch needs {self.B} prompts, got {len(prompts)}")
        if len({len(prompt) for prompt in prompts}) == 1:  # equal lengths: one batched prefill
            ids = torch.as_tensor(prompts, dtype=torch.long, device=self.device).view(self.B, -1)
            logits, streams = prefill(self.model, self.cache, ids, chunk, mtp=True)
        else:
            logits, streams = [], []
            for b, prompt in enumerate(prompts):
                ids = torch.as_tensor(prompt, dtype=torch.long, device=self.device).view(1, -1)
                row, last = prefill(self.model, self.cache.slot(b), ids, chunk, mtp=True)
                logits.append(row)
                streams.append(last)
            logits, streams = torch.cat(logits), torch.cat(streams)
        self.draft_probs = []  # a new sequence: the next draft's distribution is the one picked below
        first = self.sampler.sample(logits, slots=self.slots).tokens
        self.sampler.append(first, slots=self.slots)
        self.pending.copy_(first)                              # at positions cache.positions, not in the cache
        self.positions = [int(p) for p in self.cache.positions.tolist()]
        try:
            with self.grad_off():  # the first draft: the MTP layer at the last prompt position
                logits_m, out = self.forwards.mtp(streams, first.view(-1, 1), None)
                self.mtp_out.copy_(out)
                self.draft.copy_(self._pick(logits_m[:, -1], torch.zeros(self.B, dtype=torch.long,
                                                                         device=self.device), self.B))
        except BaseException:
            self.cache.invalidate(range(self.B))
            raise
        return first.tolist(), logits

    def start_row(self, b: int, prompt, chunk: int) -> tuple[int, torch.Tensor]:
        """Start sequence b alone while the others stand (continuous batching: a request joins a
        running batch): prefill its prompt after what its slot holds, as `start_batch` does for
        every row; its first token and logits [V]. Rows never started, or idle in a step (limit 0),
        keep nothing."""
        self._check_row(b)
        ids = torch.as_tensor(prompt, dtype=torch.long, device=self.device).view(1, -1)
        logits, streams = prefill(self.model, self.cache.slot(b), ids, chunk, mtp=True)
        first = self.sampler.sample(logits, slots=[b]).tokens
        self.sampler.append(first, slots=[b])
        self.join_row(b, int(first[0]), streams)
        return int(first[0]), logits[0]

    def _check_row(self, b: int) -> None:
        if not 0 <= b < self.B:
            raise IndexError(f"row {b} outside [0, {self.B})")
        if self.acceptance == "rejection":
            raise ValueError("rows join one by one with acceptance='match' (rejection sampling: start_batch)")

    def join_row(self, b: int, first: int, streams: torch.Tensor | None) -> None:
        """Row b joins: its cache slot holds its sequence (filled by the caller), `first` is the
        token sampled after it (already appended to sampler slot b), `streams` [1, 1, n, H] the
        main model's hidden streams at its last position (`prefill(..., mtp=True)`), or None
        when unknown (the slot was filled without them): the first draft is then a guess,
        which costs that draft only."""
        self._check_row(b)
        slot = self.cache.slot(b)
        try:
            with self.grad_off():
                self.pending[b] = first
                if streams is None:  # level with the main layers, as after the pass it skips
                    align_mtp(slot, 0)
                    self.draft[b] = first
                    self.mtp_out[b] = 0
                else:  # its pass at the last position, with the token after it
                    align_mtp(slot, 0, behind=1)
                    ids = torch.tensor([[first]], dtype=torch.long, device=self.device)
                    logits_m, out = self.model.mtp_forward(streams.to(self.device), ids, slot, logits_to_keep=1)
                    self.draft[b] = self.sampler.sample(logits_m[:, -1], slots=[b], ahead=self.pending.new_zeros(1),
                                                        tokens_only=True).tokens[0]
                    self.mtp_out[b] = out[0]
        except BaseException:
            self.cache.invalidate([b])
            raise
        self.positions[b] = int(self.cache.positions[b])
        self._forget_last(b)

    def move_row(self, dst: int, src: int) -> None:
        """Row `src`'s state goes to row `dst` (its cache slot is moved by the caller), the last
        step's rollback record with it, so a later `trim` of that sequence finds it at `dst`."""
        self.pending[dst], self.draft[dst], self.mtp_out[dst] = self.pending[src], self.draft[src], self.mtp_out[src]
        self.positions[dst] = self.positions[src]
        if self.last is None or dst == src:
            return
        forwards, undo, mtp_undo, kept = self.last
        if src < len(kept) and dst < len(kept) and kept[src] is not None:
            with self.grad_off():
                undo.move_row(dst, src)
                mtp_undo.move_row(dst, src)
            kept[dst] = kept[src]
        else:  # the record does not describe what `dst` now holds
            self._forget_last(dst)
        self._forget_last(src)

    def _forget_last(self, b: int) -> None:
        """Row b holds another sequence than in the last step: a trim leaves it alone."""
        if self.last is not None and b < len(self.last[3]):
            self.last[3][b] = None

    # ------------------------------------------------------------------ one step
    def room(self, rows: int | None = None) -> int:
        """Positions left in the cache once the pending tokens are in (the fullest of the first
        `rows` sequences)."""
        return self.cache.max_context - max(self.positions[:rows or self.B]) - 1

    def blocks_needed(self, rows: int) -> int:
        """The most KV blocks the next step over the first `rows` rows takes from a paged cache's
        pool (0 for a static cache, whose rows are reserved): every row its forwards run (the
        next power of two in graph or compile mode) takes 1 + N tokens tentatively, idle and
        padding rows too (they give them back after the step). Compare with
        `cache.pool.num_available` before the step: a step that does not fit raises
        PoolExhausted before it runs, changing nothing."""
        cache = self.forwards_for(rows).cache
        return cache.blocks_needed(1 + self.n) if hasattr(cache, "blocks_needed") else 0

    def _pick(self, logits: torch.Tensor, ahead: torch.Tensor, width: int) -> torch.Tensor:
        """Drafts [width] from the MTP layer's logits [width, V], for the tokens `ahead` [width]
        places past each slot's next one."""
        if self.acceptance == "rejection":
            q = self.sampler.probabilities(logits, slots=self.slots[:width], ahead=ahead)
            self.draft_probs.append(q)
            return torch.multinomial(q, 1, generator=self.generator)[:, 0]
        return self.sampler.sample(logits, slots=self.slots[:width], ahead=ahead, tokens_only=True).tokens

    def _draft(self, forwards, n: int, width: int) -> torch.Tensor:
        """n draft tokens [width, n] for the positions after the pending ones: the first from the
        last MTP pass, the others from one-token passes, rolled back afterwards."""
        drafts, out, undos = [self.draft[:width]], self.mtp_out[:width], []
        for k in range(1, n):
            undos.append(Rollback())
            logits, out = forwards.mtp(out, drafts[-1].view(-1, 1), undos[-1])
            drafts.append(self._pick(logits[:, -1], torch.full((width,), k, dtype=torch.long, device=self.device),
                                     width))
        zero = torch.zeros(width, dtype=torch.long, device=self.device)
        for undo in reversed(undos):
            forwards.rollback(undo, zero)
        return torch.stack(drafts, dim=1)

    def step(self, limit: int) -> tuple[list[int], torch.Tensor]:
        """One verify step (batch 1): the tokens it emits (at most `limit`, >= 1) and the verified
        logits they were sampled from [k, V] (fp32 rows of the main model at their positions)."""
        tokens, rows = self.step_batch([limit])
        return tokens[0], rows[0]

    def step_batch(self, limits: list[int], allowed: torch.Tensor | None = None, logprobs: int | None = None,
                   detailed: bool = False, record: bool = True) -> tuple[list[list[int]], list[torch.Tensor]]:
        """One verify step of the first len(limits) sequences: each one's emitted tokens (at most
        its limit, >= 1) and the fp32 logits [k, V] they were sampled from. A limit of 0 leaves
        that row as it was (an idle row: it takes part in the forwards, keeps nothing).

        A server's step (`detailed`): the verified rows are sampled with the sampler's checks, and
        `self.last_sample` keeps its output (row b's position j at b * (N + 1) + j: logprobs when
        `logprobs` k is given); `allowed` [len(limits), V] masks each row's first token (a
        grammar: give such a row limit 1); a row keeps no token past the first whose logits are
        not finite, and one whose first is not comes back with no token (`failed_rows`, the
        pending token fed as plain decoding's failed step would have). `record=False`: the
        caller appends the tokens it takes to the sampler."""
        r = len(limits)
        if not 1 <= r <= self.B or min(limits) < 0 or max(limits) < 1:
            raise ValueError(f"step_batch needs 1 to {self.B} limits >= 0, one at least 1, got {limits}")
        forwards = self.forwards_for(r)
        B = forwards.cache.batch_size  # the rows the forwards run: r, or a power of two past it
        limits = list(limits) + [0] * (B - r)
        device = self.device
        # Captured and compiled forwards keep their one shape: the step drafts N even when fewer
        # tokens are wanted (`limits` caps what is kept); eager ones draft only what can be kept.
        wanted = self.n if forwards.mode != "eager" else max(limits) - 1
        n = max(0, min(self.n, wanted, self.room(r)))
        T = n + 1
        idle_rows = min(limits) == 0
        if self.acceptance == "rejection":
            if idle_rows:  # (an idle row would need its draft's distribution kept too)
                raise ValueError(f"rejection sampling steps every row, got limits {limits}")
            self.draft_probs = self.draft_probs[:1] if n else []
        pending = self.pending[:B]
        if idle_rows:  # idle rows keep their state (copies: a captured graph's outputs change in place)
            mtp_before, draft_before = self.mtp_out[:B].clone(), self.draft[:B].clone()
        self.last_sample, self.failed_rows = None, []
        # A paged cache's tables take the step's tokens before anything runs (their ids stay on
        # the device: only the shape is read), so PoolExhausted leaves every row as it was.
        forwards.cache.take_tokens(pending.new_empty(B, T), tentative=True)
        try:
            with self.grad_off():
                drafts = self._draft(forwards, n, B) if n else pending.new_zeros(B, 0)
                fed = torch.cat([pending.view(B, 1), drafts.to(pending.dtype)], dim=1)
                undo = Rollback()
                logits, streams = forwards.verify(fed, undo)
                rows = logits.float()                                              # [B, T, V]
                accepted, tokens, usable = self._accept(rows, drafts, n, allowed, logprobs, detailed)
                caps = [min(limit, T) for limit in limits]
                if min(caps) < T or usable is not None:  # a sequence may keep fewer than it could
                    cap = torch.tensor(caps, device=device)
                    if usable is not None:  # no token past the first one whose logits are not finite
                        cap = torch.minimum(cap, usable.clamp(min=1))
                    accepted = torch.minimum(accepted, cap - 1)
                keep = accepted + 1                                            # 0: an idle row
                accepted = accepted.clamp(min=0)
                forwards.rollback(undo, keep)
                # The MTP layer catches up on the verified positions and keeps the accepted ones;
                # its pass at the last kept position drafts the next step's first token.
                mtp_undo = Rollback()
                logits_m, mtp_out = forwards.catch_up(streams, tokens, accepted, mtp_undo)
                forwards.rollback(mtp_undo, keep)
                if self.acceptance == "rejection":
                    self.draft_probs = []
                draft, new_pending = self._pick(logits_m[:, -1], keep, B), tokens.gather(1, accepted.view(B, 1)).view(B)
                if idle_rows:
                    idle = keep == 0
                    draft = torch.where(idle, draft_before, draft)
                    new_pending = torch.where(idle, pending, new_pending)
                    mtp_out = torch.where(idle.view(B, 1, 1, 1), mtp_before, mtp_out)
                self.draft[:B], self.pending[:B], self.mtp_out[:B] = draft, new_pending, mtp_out
                read = [(keep - 1).view(B, 1), tokens, fed]  # (fed: the ids a paged cache's tables keep)
                if usable is not None:
                    read.append(usable.view(B, 1))
                host = torch.cat(read, dim=1).tolist()  # the one host read
                fault_point("decode")  # (where an asynchronous device error surfaces: the step ran)
                synchronize(device)
        except BaseException:
            self.cache.invalidate(range(B))
            raise
        for b, row in enumerate(host):  # a paged cache's tables let the rejected tokens go, name the kept
            forwards.cache.drop_tokens(b, T - (row[0] + 1))
            forwards.cache.name_tokens(b, row[1 + T:2 + T + row[0]])
        # Per row, the tokens the step kept; None for a row it left as it was (idle), which no
        # trim may touch: a request joining that row later is not the step's.
        self.last = (forwards, undo, mtp_undo, [row[0] + 1 or None for row in host])
        out, out_rows = [], []
        for b, row in enumerate(host[:r]):
            a = row[0]
            if usable is not None and row[-1] == 0 and a >= 0:  # its first token cannot be sampled
                self.failed_rows.append(b)
                out.append([])
                out_rows.append(rows[b, :0])
                self.positions[b] += 1  # the pending token was fed
                continue
            out.append(row[1:a + 2])
            out_rows.append(rows[b, :a + 1])
            if a < 0:
                continue  # idle
            self.positions[b] += a + 1
            self.stats.steps += 1
            self.stats.drafted += n
            self.stats.accepted += a
            self.stats.emitted += a + 1
        if record:
            self.sampler.append(torch.tensor([t for o in out for t in o], device=device),
                                slots=[b for b, o in enumerate(out) for _ in o])
        return out, out_rows

    def _accept(self, rows: torch.Tensor, drafts: torch.Tensor, n: int, allowed=None, logprobs=None,
                detailed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(accepted drafts [B], the tokens at the T verified positions' next positions [B, T]: the
        first accepted + 1 of them are emitted, the leading positions whose logits are usable [B]
        or None when not `detailed`) from the verified logits [B, T, V]."""
        B, T, V = rows.shape
        slots = self.slot_index[:B].repeat_interleave(T)
        ahead = torch.arange(T, device=self.device).repeat(B)
        # Row j's history holds the drafts before it (penalties and min_tokens see them, as plain
        # decoding's would)
        prior = None
        if n:
            before = torch.arange(n, device=self.device) < torch.arange(T, device=self.device)[:, None]  # [T, n]
            prior = (drafts.repeat_interleave(T, dim=0), before.repeat(B, 1))
        mask = None
        if allowed is not None:  # each row's first position; the rest (never kept: limit 1) unmasked
            mask = torch.ones(B, T, V, dtype=torch.bool, device=self.device)
            mask[:allowed.shape[0], 0] = allowed.to(self.device)
            mask = mask.view(B * T, V)
        if self.acceptance == "rejection":  # the target of position j is plain sampling's after d0..d(j-1)
            p = self.sampler.probabilities(rows.reshape(B * T, V), slots=slots, allowed=mask, ahead=ahead,
                                           prior=prior).view(B, T, V)
            q = torch.stack(self.draft_probs, dim=1) if n else p[:, :0]   # [B, n, V]
            tokens = torch.zeros(B, T, dtype=torch.long, device=self.device)
            accepted = torch.zeros(B, dtype=torch.long, device=self.device)
            for b in range(B):
                emitted = rejection_sample(p[b], q[b], drafts[b], self.generator)
                tokens[b, :emitted.shape[0]] = emitted
                accepted[b] = emitted.shape[0] - 1
            return accepted, tokens, None
        out = self.sampler.sample(rows.reshape(B * T, V), mask, logprobs, slots=slots, ahead=ahead,
                                  tokens_only=not detailed, prior=prior)
        target = out.tokens.view(B, T)
        usable = None
        if detailed:
            self.last_sample = out
            usable = (~out.failed.view(B, T)).long().cumprod(1).sum(1)
        if not n:
            return torch.zeros(B, dtype=torch.long, device=self.device), target, usable
        return (target[:, :n] == drafts).long().cumprod(1).sum(1), target, usable

    # ------------------------------------------------------------------ stopping short
    def trim(self, used: list[int]) -> None:
        """Rows that took fewer of the last step's tokens than it emitted (`used[b]`, for the first
        len(used) rows; None: all of them) give the rest back: the cache holds what plain
        decoding would have fed (every taken token but the last), the MTP layer one position
        behind (its pass at the last position needs the token after it). Only those rows are
        written: the batch may have changed since the step (rows moved with `move_row`, joined,
        released), and every other row is left exactly as it is."""
        if self.last is None:
            return
        forwards, undo, mtp_undo, kept = self.last
        keep, mtp_keep = [-1] * len(kept), [-1] * len(kept)  # -1: the rollback leaves the row alone
        for b, u in enumerate(used[:len(kept)]):
            if u is not None and kept[b] is not None and 0 <= u < kept[b]:
                keep[b], mtp_keep[b] = u, max(u - 1, 0)
        if keep == [-1] * len(kept):
            return
        for b, k in enumerate(keep):  # (a paged cache: before the apply, which clears rows in the kept blocks)
            if k >= 0:
                self.cache.drop_tokens(b, kept[b] - k)
        with self.grad_off():
            forwards.rollback(undo, torch.tensor(keep, device=self.device))
            forwards.rollback(mtp_undo, torch.tensor(mtp_keep, device=self.device))
        for b, k in enumerate(keep):
            if k >= 0:
                self.positions[b] -= kept[b] - k
                kept[b] = k

    def finish(self, unused: int = 0) -> None:
        """Leave the cache as plain decoding would have (batch 1): holding every token but the last
        one taken, when the caller took all but `unused` of the last step's tokens (an EOS among
        them, or it stopped early). The MTP layer is left one position behind (its input at the
        last position needs the token after it, which the next prompt decides)."""
        if self.last is None or self.cache.is_invalid(0) or self.last[3][0] is None:
            return
        forwards, undo, mtp_undo, kept = self.last
        keep = kept[0] - unused
        self.cache.drop_tokens(0, unused)
        with self.grad_off():
            forwards.rollback(undo, torch.tensor([keep], device=self.device))
            forwards.rollback(mtp_undo, torch.tensor([max(keep - 1, 0)], device=self.device))
        self.positions[0] -= unused
        self.last = None
