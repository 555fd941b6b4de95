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
(the caller needs them); positions, acceptance and the rollback stay on the device.

The MTP layer's cache (`cache.mtp`, its own positions) only ever keeps positions fed with the
main model's hidden streams and true tokens: its one-token drafting passes are rolled back the
same way, and its catch-up pass over the verified positions keeps the accepted ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import DS4Cache, Rollback
from .decode import make_forwards, prefill, synchronize
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

    `acceptance`: "match" (the default, see the module docstring: the tokens of plain decoding
    with the same sampler) or "rejection" (batch 1): drafts drawn from the MTP layer's
    distribution and accepted by `rejection_sample` with `generator`, the textbook algorithm,
    for samplers whose noise is not a function of the position (the same distribution, other
    tokens).

    `mode`: how the three forwards of a step run: "eager", or "graph" / "compile" (see
    `ds4_torch.decode`): one captured or compiled function per fixed shape."""

    def __init__(self, model, cache: DS4Cache, sampler: BatchSampler, draft_tokens: int,
                 stats: SpeculationStats | None = None, acceptance: str = "match",
                 generator: torch.Generator | None = None, batch: int = 1, mode: str = "eager"):
        check_draft_tokens(model, draft_tokens)
        if acceptance not in ("match", "rejection"):
            raise ValueError(f"acceptance must be 'match' or 'rejection', got {acceptance!r}")
        if acceptance == "rejection" and batch != 1:
            raise ValueError("rejection sampling runs one sequence at a time (batch=1)")
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
        self.forwards = make_forwards(model, self.cache, mode)  # eager, captured or compiled
        # Captures and compiles trace under no_grad; eager steps skip autograd's bookkeeping entirely.
        self.grad_off = torch.inference_mode if self.forwards.mode == "eager" else torch.no_grad
        self.last = None  # what finish() needs of the last step
        self.draft_probs: list[torch.Tensor] = []  # "rejection": the distributions the drafts came from

    # ------------------------------------------------------------------ start
    def start(self, prompt_ids: torch.Tensor, chunk: int) -> tuple[int, torch.Tensor]:
        """Prefill `prompt_ids` [1, T] (batch 1); the first token and its logits [V]."""
        tokens, logits = self.start_batch([prompt_ids.view(-1).tolist()], chunk)
        return tokens[0], logits[0]

    def _align_mtp(self, b: int) -> None:
        """Put sequence b's MTP layer at the main model's position before a prefill: a layer
        ahead of it is reset (its rows would belong to other tokens), one behind it moves up
        (the prefill feeds it from there)."""
        mtp_cache = self.cache.mtp
        held, main = int(mtp_cache.positions[b]), int(self.cache.positions[b])
        if held > main:
            mtp_cache.reset(b)
        if held != main:
            mtp_cache.positions[b] = main

    def start_batch(self, prompts, chunk: int) -> tuple[list[int], torch.Tensor]:
        """Prefill each sequence's prompt (main and MTP layers; lengths may differ) after what its
        cache slot already holds; the first tokens and their logits [B, V]. The MTP state is moved
        to where the main layers stand: a lagging one (a previous call left its last position
        unfed, or the cache was filled without it) skips the positions it lacks, one ahead (main
        layers rewound without it) starts blank. Either only costs drafts: the output is the same,
        and the MTP positions never run ahead."""
        if len(prompts) != self.B:
            raise ValueError(f"start_batch needs {self.B} prompts, got {len(prompts)}")
        logits, streams = [], []
        for b, prompt in enumerate(prompts):
            self._align_mtp(b)
            ids = torch.as_tensor(prompt, dtype=torch.long, device=self.device).view(1, -1)
            row, last = prefill(self.model, self.cache.slot(b), ids, chunk, mtp=True)
            logits.append(row)
            streams.append(last)
        logits, streams = torch.cat(logits), torch.cat(streams)
        first = self.sampler.sample(logits, slots=self.slots).tokens
        self.sampler.append(first, slots=self.slots)
        self.pending = first                                   # [B] at positions cache.positions, not in the cache
        self.positions = [int(p) for p in self.cache.positions.tolist()]  # host copies, moved by what steps emit
        try:
            with self.grad_off():  # the first draft: the MTP layer at the last prompt position
                logits_m, self.mtp_out = self.forwards.mtp(streams, first.view(-1, 1), None)
                self.draft = self._pick(logits_m[:, -1], torch.zeros(self.B, dtype=torch.long, device=self.device))
        except BaseException:
            self.cache.invalidate(range(self.B))
            raise
        return first.tolist(), logits

    def start_row(self, b: int, prompt, chunk: int) -> tuple[int, torch.Tensor]:
        """Start sequence b alone while the others stand (continuous batching: a request joins a
        running batch): prefill its prompt after what its slot holds, as `start_batch` does for
        every row; its first token and logits [V]. Rows never started, or idle in a step (limit 0),
        keep nothing."""
        if not 0 <= b < self.B:
            raise IndexError(f"row {b} outside [0, {self.B})")
        if self.acceptance == "rejection":
            raise ValueError("start_row is for acceptance='match' (rejection sampling: start_batch, batch 1)")
        if not hasattr(self, "pending"):  # the batch's state, rows not started included
            H, n = self.model.config.hidden_size, self.model.config.hc_mult
            self.pending = torch.zeros(self.B, dtype=torch.long, device=self.device)
            self.draft = torch.zeros_like(self.pending)
            self.mtp_out = torch.zeros(self.B, 1, n, H, dtype=self.model.dtype, device=self.device)
            self.positions = [int(p) for p in self.cache.positions.tolist()]
        slot = self.cache.slot(b)
        self._align_mtp(b)
        ids = torch.as_tensor(prompt, dtype=torch.long, device=self.device).view(1, -1)
        logits, streams = prefill(self.model, slot, ids, chunk, mtp=True)
        first = self.sampler.sample(logits, slots=[b]).tokens
        self.sampler.append(first, slots=[b])
        try:
            with self.grad_off():
                logits_m, out = self.model.mtp_forward(streams, first.view(1, 1), slot, logits_to_keep=1)
                draft = self.sampler.sample(logits_m[:, -1], slots=[b], ahead=torch.zeros_like(first),
                                            tokens_only=True).tokens
                self.pending[b], self.draft[b], self.mtp_out[b] = first[0], draft[0], out[0]
        except BaseException:
            self.cache.invalidate([b])
            raise
        self.positions[b] = int(self.cache.positions[b])
        return int(first[0]), logits[0]

    # ------------------------------------------------------------------ one step
    def room(self) -> int:
        """Positions left in the cache once the pending tokens are in (the fullest sequence's)."""
        return self.cache.max_context - max(self.positions) - 1

    def _pick(self, logits: torch.Tensor, ahead: torch.Tensor) -> torch.Tensor:
        """Drafts [B] from the MTP layer's logits [B, V], for the tokens `ahead` [B] places past
        each slot's next one."""
        if self.acceptance == "rejection":
            q = self.sampler.probabilities(logits, slots=self.slots)
            self.draft_probs.append(q[0])
            return torch.multinomial(q, 1, generator=self.generator)[:, 0]
        return self.sampler.sample(logits, slots=self.slots, ahead=ahead, tokens_only=True).tokens

    def _draft(self, n: int) -> torch.Tensor:
        """n draft tokens [B, n] for the positions after the pending ones: the first from the last
        MTP pass, the others from one-token passes, rolled back afterwards."""
        drafts, out, undos = [self.draft], self.mtp_out, []
        for k in range(1, n):
            undos.append(Rollback())
            logits, out = self.forwards.mtp(out, drafts[-1].view(-1, 1), undos[-1])
            drafts.append(self._pick(logits[:, -1], torch.full((self.B,), k, dtype=torch.long, device=self.device)))
        zero = torch.zeros(self.B, dtype=torch.long, device=self.device)
        for undo in reversed(undos):
            self.forwards.rollback(undo, zero)
        return torch.stack(drafts, dim=1)

    def step(self, limit: int) -> tuple[list[int], torch.Tensor]:
        """One verify step (batch 1): the tokens it emits (at most `limit`, >= 1) and the verified
        logits they were sampled from [k, V] (fp32 rows of the main model at their positions)."""
        tokens, rows = self.step_batch([limit])
        return tokens[0], rows[0]

    def step_batch(self, limits: list[int]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """One verify step of every sequence: each one's emitted tokens (at most its limit, >= 1)
        and the fp32 logits [k, V] they were sampled from. A limit of 0 leaves that row as it
        was (an idle row of a fixed batch: it takes part in the forwards, keeps nothing)."""
        B, device = self.B, self.device
        if len(limits) != B or min(limits) < 0 or max(limits) < 1:
            raise ValueError(f"step_batch needs {B} limits >= 0, one at least 1, got {limits}")
        # Captured and compiled forwards keep their one shape: the step drafts N even when fewer
        # tokens are wanted (`limits` caps what is kept); eager ones draft only what can be kept.
        wanted = self.n if self.forwards.mode != "eager" else max(limits) - 1
        n = max(0, min(self.n, wanted, self.room()))
        T = n + 1
        if self.acceptance == "rejection":
            self.draft_probs = self.draft_probs[:1] if n else []
        # an idle row keeps its MTP output (a copy: a captured graph's outputs are overwritten in place)
        self.mtp_out_before = self.mtp_out.clone() if min(limits) == 0 else None
        try:
            fault_point("decode")
            with self.grad_off():
                drafts = self._draft(n) if n else self.pending.new_zeros(B, 0)
                fed = torch.cat([self.pending.view(B, 1), drafts.to(self.pending.dtype)], dim=1)
                undo = Rollback()
                logits, streams = self.forwards.verify(fed, undo)
                rows = logits.float()                                              # [B, T, V]
                accepted, tokens = self._accept(rows, drafts, n)
                caps = [min(limit, T) for limit in limits]
                if min(caps) < T:  # a sequence may keep fewer than it could
                    accepted = torch.minimum(accepted, torch.tensor(caps, device=device) - 1)
                keep = accepted + 1                                            # 0: an idle row
                idle = keep == 0 if min(caps) == 0 else None
                accepted = accepted.clamp(min=0)
                self.forwards.rollback(undo, keep)
                # The MTP layer catches up on the verified positions and keeps the accepted ones;
                # its pass at the last kept position drafts the next step's first token.
                mtp_undo = Rollback()
                logits_m, self.mtp_out = self.forwards.catch_up(streams, tokens, accepted, mtp_undo)
                self.forwards.rollback(mtp_undo, keep)
                if self.acceptance == "rejection":
                    self.draft_probs = []
                draft, pending = self._pick(logits_m[:, -1], keep), tokens.gather(1, accepted.view(B, 1)).view(B)
                if idle is not None:  # idle rows keep their state
                    draft = torch.where(idle, self.draft, draft)
                    pending = torch.where(idle, self.pending, pending)
                    self.mtp_out = torch.where(idle.view(B, 1, 1, 1), self.mtp_out_before, self.mtp_out)
                self.draft, self.pending = draft, pending
                host = torch.cat([(keep - 1).view(B, 1), tokens], dim=1).tolist()  # the one host read
                synchronize(device)
        except BaseException:
            self.cache.invalidate(range(B))
            raise
        self.last = (undo, mtp_undo, [row[0] + 1 for row in host])
        out, out_rows = [], []
        for b, row in enumerate(host):
            a = row[0]
            out.append(row[1:a + 2])
            out_rows.append(rows[b, :a + 1])
            if a < 0:
                continue  # idle
            self.positions[b] += a + 1
            self.stats.steps += 1
            self.stats.drafted += n
            self.stats.accepted += a
            self.stats.emitted += a + 1
        self.sampler.append(torch.tensor([t for o in out for t in o], device=device),
                            slots=[b for b, o in enumerate(out) for _ in o])
        return out, out_rows

    def _accept(self, rows: torch.Tensor, drafts: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted drafts [B], the tokens at the T verified positions' next positions [B, T]: the
        first accepted + 1 of them are emitted) from the verified logits [B, T, V]."""
        B, T, V = rows.shape
        if self.acceptance == "rejection":
            p = self.sampler.probabilities(rows[0], slots=[0] * T)
            q = torch.stack(self.draft_probs) if n else p[:0]
            emitted = rejection_sample(p, q, drafts[0], self.generator)
            tokens = torch.cat([emitted, emitted.new_zeros(T - emitted.shape[0])])
            return torch.tensor([emitted.shape[0] - 1], device=self.device), tokens.view(1, T)
        slots = self.slot_index.repeat_interleave(T)
        ahead = torch.arange(T, device=self.device).repeat(B)
        # Row j's history holds the drafts before it (penalties see them, as plain decoding's would)
        prior = None
        if n:
            before = torch.arange(n, device=self.device) < torch.arange(T, device=self.device)[:, None]  # [T, n]
            prior = (drafts.repeat_interleave(T, dim=0), before.repeat(B, 1))
        target = self.sampler.sample(rows.reshape(B * T, V), slots=slots, ahead=ahead, tokens_only=True,
                                     prior=prior).tokens
        target = target.view(B, T)
        if not n:
            return torch.zeros(B, dtype=torch.long, device=self.device), target
        return (target[:, :n] == drafts).long().cumprod(1).sum(1), target

    # ------------------------------------------------------------------ stopping short
    def finish(self, unused: int = 0) -> None:
        """Leave the cache as plain decoding would have (batch 1): holding every token but the last
        one taken, when the caller took all but `unused` of the last step's tokens (an EOS among
        them, or it stopped early). The MTP layer is left one position behind (its input at the
        last position needs the token after it, which the next prompt decides)."""
        if self.last is None or self.cache.is_invalid(0):
            return
        undo, mtp_undo, kept = self.last
        keep = kept[0] - unused
        with self.grad_off():
            self.forwards.rollback(undo, torch.tensor([keep], device=self.device))
            self.forwards.rollback(mtp_undo, torch.tensor([max(keep - 1, 0)], device=self.device))
        self.last = None
