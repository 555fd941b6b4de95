"""Speculative decoding with the model's own MTP layer (DeepSeek-V4's multi-token prediction).

Each step drafts N tokens with the MTP layer (`DS4ForCausalLM.mtp_forward`, fed back its own
output for drafts past the first) and verifies them in one forward of the main model over the
tokens not yet in its cache plus the N drafts. Tokens are chosen by `BatchSampler` with noise
that depends only on (seed, position): the drafts with the noise of the positions they draft,
the verified positions with their own, all 1 + N rows in one call. A draft is accepted exactly
when it equals the token the main model samples at its position (greedy: its argmax), and the
first mismatch is replaced by that token (the bonus token when all N match). So the tokens are
the ones plain decoding with the same sampler gives, whatever the drafts: speculation changes
only how many forwards it takes.

Rollback (exact, with the checkpoint machinery of `DS4Cache`): a checkpoint of the main layers
is taken before a verify forward. When a draft is rejected, the cache is restored to it (the
ring, the open windows and overlaps, and any compressed row a rejected token closed), and the
accepted tokens, which are no longer in the cache, are fed again in front of the next step's
drafts: in the same forward, so a rejection costs a longer verify forward, not an extra one.
The MTP layer's cache (`cache.mtp`, its own positions) only ever holds positions fed with the
main model's hidden streams and true tokens; drafts past the first run on it after a checkpoint
of its own and are rolled back the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import DS4Cache
from .decode import prefill, synchronize
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
    """Speculative decoding of sequence 0 of `cache` (batch size 1) with `sampler` slot 0.

        spec = Speculator(model, cache, sampler, draft_tokens=N)
        first = spec.start(prompt_ids, chunk)       # prefill; the first token
        tokens, logits = spec.step(limit)          # 1 .. N+1 tokens, and the logits they came from

    `limit`: the most tokens this step may emit (drafts are cut to fit it and the cache).

    `acceptance`: "match" (the default, see the module docstring: the tokens of plain decoding
    with the same sampler) or "rejection": drafts drawn from the MTP layer's distribution and
    accepted by `rejection_sample` with `generator`, the textbook algorithm, for samplers whose
    noise is not a function of the position (the same distribution, other tokens)."""

    def __init__(self, model, cache: DS4Cache, sampler: BatchSampler, draft_tokens: int,
                 stats: SpeculationStats | None = None, acceptance: str = "match",
                 generator: torch.Generator | None = None):
        check_draft_tokens(model, draft_tokens)
        if acceptance not in ("match", "rejection"):
            raise ValueError(f"acceptance must be 'match' or 'rejection', got {acceptance!r}")
        self.acceptance, self.generator = acceptance, generator
        if cache.mtp is None:
            raise ValueError("the cache has no MTP layer state: make it with the MTP model's new_cache()")
        self.model, self.cache, self.sampler, self.n = model, cache.narrow(1), sampler, draft_tokens
        self.stats = stats if stats is not None else SpeculationStats()
        self.device = cache.device
        self.checkpoint = None  # of the main layers at the cache's position, while it still holds there

    def start(self, prompt_ids: torch.Tensor, chunk: int) -> tuple[int, torch.Tensor]:
        """Prefill `prompt_ids` [1, T] (main and MTP layers); the first token and its logits [V].
        The MTP state is moved to where the main layers stand: a lagging one (a previous call
        left its last positions unfed, or the cache was filled without it) skips the positions
        it lacks, one ahead (main layers rewound without it) starts blank. Either only costs
        drafts: the output is the same, and the MTP positions never run ahead."""
        mtp_cache = self.cache.mtp
        held, main = int(mtp_cache.positions[0]), int(self.cache.positions[0])
        if held > main:
            mtp_cache.reset(0)
        if held != main:
            mtp_cache.positions[0] = main
        logits, streams = prefill(self.model, self.cache, prompt_ids, chunk, mtp=True)
        token = self.sampler.sample(logits).tokens
        self.sampler.append(token)
        self.pending = token.view(1, 1)           # tokens at positions cache.positions.. not in the cache
        self.mtp_streams, self.mtp_ids = streams, token.view(1, 1)  # what the MTP layer is fed next
        return int(token), logits[0]

    def finish(self, unused: int = 0) -> None:
        """Leave the cache as plain decoding would have: holding every token but the last one
        taken, when the caller took all but `unused` of the last step's tokens (an EOS among
        them, or it stopped early). Rewinds to the last step's checkpoint where that step put
        more in the cache, then feeds the true tokens up to there."""
        if self.cache.is_invalid(0) or (unused == 0 and self.pending.shape[1] == 1):
            return
        if unused and self.last_full:  # its drafts past the last token taken are in the cache
            self.cache.restore_checkpoint(0, self.last_checkpoint)
        keep = self.last_L - 1 + self.last_emitted - unused  # true tokens from the checkpoint on
        with torch.inference_mode():
            if keep:
                self.model._forward(self.last_true[:, :keep], self.cache, logits_to_keep=1)
        self.pending, self.checkpoint = self.last_true[:, keep:keep + 1], None

    def room(self) -> int:
        """Positions left in the cache once the pending tokens are in."""
        return self.cache.max_context - int(self.cache.positions[0]) - self.pending.shape[1]

    def _draft(self, n: int) -> torch.Tensor:
        """n draft tokens [1, n] for the positions after the last pending token."""
        model, mtp_cache = self.model, self.cache.mtp
        logits, out = model.mtp_forward(self.mtp_streams, self.mtp_ids, self.cache, logits_to_keep=1)
        self.draft_probs = []  # the distributions the drafts came from ("rejection")
        drafts = [self._pick(logits[:, -1], 0)]
        if n > 1:
            self.mtp_checkpoint = mtp_cache.take_checkpoint(0)  # the drafts past the first are rolled back
        for k in range(1, n):
            logits, out = model.mtp_forward(out[:, -1:], drafts[-1].view(1, 1), self.cache)
            drafts.append(self._pick(logits[:, -1], k))
        if n > 1:
            mtp_cache.restore_checkpoint(0, self.mtp_checkpoint)
        return torch.stack(drafts, dim=1)

    def _pick(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        """Draft k [1] from the MTP layer's logits [1, V]."""
        if self.acceptance == "rejection":
            q = self.sampler.probabilities(logits)
            self.draft_probs.append(q[0])
            return torch.multinomial(q, 1, generator=self.generator)[0]
        return self.sampler.sample(logits, ahead=torch.full((1,), k, dtype=torch.long, device=self.device)).tokens

    def _verify(self, rows: torch.Tensor, drafts: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(accepted drafts, emitted tokens) from the verified logits [n+1, V]."""
        n = drafts.shape[0]
        if self.acceptance == "rejection":
            p = self.sampler.probabilities(rows, slots=[0] * (n + 1))
            q = torch.stack(self.draft_probs) if n else p[:0]
            tokens = rejection_sample(p, q, drafts, self.generator)
            return tokens.shape[0] - 1, tokens
        ahead = torch.arange(n + 1, device=self.device)
        target = self.sampler.sample(rows, slots=[0] * (n + 1), ahead=ahead).tokens
        accepted = int((target[:n] == drafts).long().cumprod(0).sum())  # the one host read
        return accepted, target[:accepted + 1]

    def step(self, limit: int) -> tuple[list[int], torch.Tensor]:
        """One verify step: the tokens it emits (at most `limit`, >= 1) and the verified logits
        they were sampled from [k, V] (fp32 rows of the main model at their positions)."""
        n = max(0, min(self.n, limit - 1, self.room()))
        L = self.pending.shape[1]
        try:
            fault_point("decode")
            with torch.inference_mode():
                drafts = self._draft(n) if n else self.pending.new_zeros(1, 0)
                if n and self.checkpoint is None:
                    self.checkpoint = self.cache.take_checkpoint(0)
                fed = torch.cat([self.pending, drafts], dim=1)
                logits, streams = self.model._forward(fed, self.cache, logits_to_keep=n + 1, return_streams=True)
                rows = logits[0].float()                                          # positions E .. E+n
                accepted, tokens = self._verify(rows, drafts[0])
                # What `finish` needs: the true tokens from the checkpoint's position on, and how
                # many this step emitted.
                self.last_true = torch.cat([fed[:, :L + accepted], tokens[-1:].view(1, 1)], dim=1)
                self.last_L, self.last_emitted, self.last_full = L, accepted + 1, accepted == n
                self.last_checkpoint = self.checkpoint
                if accepted < n:  # a rejected draft is in the cache: back to the checkpoint
                    self.cache.restore_checkpoint(0, self.checkpoint)
                    self.pending = self.last_true
                else:
                    self.checkpoint = None
                    self.pending = tokens[-1:].view(1, 1)
                # The MTP layer catches up on the true positions E .. E+accepted.
                self.mtp_streams = streams[:, L - 1:L + accepted]
                self.mtp_ids = tokens.view(1, -1)
                synchronize(self.device)
        except BaseException:
            self.cache.invalidate([0])
            raise
        self.sampler.append(tokens, slots=[0] * tokens.numel())
        self.stats.steps += 1
        self.stats.drafted += n
        self.stats.accepted += accepted
        self.stats.emitted += accepted + 1
        return tokens.tolist(), rows[:accepted + 1]
