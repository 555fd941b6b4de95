"""The runner: the only part of the server that touches tensors (besides the library's cache and
sampler, which it owns): prefill chunks, decode steps, cache copies and checkpoints (through the
`Replica`, on every rank under tensor parallelism), and the batched sampler.

- `run(operation, *args)`: one replica operation, by name with plain arguments; under tensor
  parallelism (`peers`, a serve.core.tp.Lead) sent to the other ranks first and acknowledged after
  (serve.core.tp). Sessions (serve.engine.sessions) run their cache copies and checkpoints through it too.
- `prefill` / `decode`: the model, timed (wall and this thread's CPU: the host time that bench
  serve reports excludes them).
- `admit` / `move` / `release`: a request's sampling settings in its sampler slot (written once,
  when it takes its batch slot; moved with it).
- `sample(reqs, logits, slots)`: one `BatchSampler` call for the whole batch (grammar masks built
  from each constrained request, logprobs to the deepest asked): per request a `Drawn` (the token
  it takes, after its grammar's closing policy, with its logprob and top ones) or the exception
  that fails it alone (settings that raise, NaN or inf logits). `append` records what was taken.

Nothing here reads a tensor back to the host inside a step but the step's token ids (and the
logprobs asked for), once, after the sampler.
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass

import torch

from .replica import MODEL_OPERATIONS, Replica
from .sequence import GenRequest

log = logging.getLogger("ds4.serve")


class SamplingFailed(Exception):
    """A request's row could not be sampled (its logits are not finite, or nothing is allowed)."""


@dataclass
class Drawn:
    token: int
    logprob: float | None = None              # raw log-softmax of `token` (when the request asked)
    top: list[tuple[int, float]] | None = None


class Runner:
    def __init__(self, model, *, ctx: int, sessions: int, batch_slots: int, decode_mode: str, peers=None,
                 speculative_tokens: int = 0, kv_blocks: int | None = None, kv_block_tokens: int = 256,
                 kv_rows: str = "full"):
        self.replica = Replica(model, ctx=ctx, sessions=sessions, batch_slots=batch_slots, decode_mode=decode_mode,
                               speculative_tokens=speculative_tokens, kv_blocks=kv_blocks,
                               kv_block_tokens=kv_block_tokens, kv_rows=kv_rows)
        self.peers = peers
        if peers is not None:
            peers.open(self.replica.shape())
        self.ctx = ctx
        self.device = model.device
        self.vocab_size = model.config.vocab_size
        self.sampler = self.replica.sampler
        self.draft_tokens = speculative_tokens
        # Time in the model and the sampler since `clear_timers` (wall; CPU of the calling thread).
        self.model_s = self.sampling_s = self.cpu_s = 0.0

    # The replica's caches and decoder (the app's log line, snapshots, tests).
    resident = property(lambda self: self.replica.resident)
    pool = property(lambda self: self.replica.pool)
    batch = property(lambda self: self.replica.batch)
    decoder = property(lambda self: self.replica.decoder)

    def clear_timers(self) -> None:
        self.model_s = self.sampling_s = self.cpu_s = 0.0

    def run(self, operation: str, *args):
        """Run one replica operation: on every rank under tensor parallelism (sent first, and
        acknowledged by every rank after: see serve.core.tp), else here."""
        if self.peers is None:
            return getattr(self.replica, operation)(*args)
        step = self.peers.send(operation, args, model=operation in MODEL_OPERATIONS)
        try:
            result = getattr(self.replica, operation)(*args)
        except BaseException:
            self.peers.acknowledge(step, ok=False)  # a fault on every rank alike: recovered as usual
            raise
        self.peers.acknowledge(step, ok=True)
        return result

    def _timed_model(self, operation: str, *args):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self.run(operation, *args)
        finally:
            self.cpu_s += time.thread_time() - c0
            self.model_s += time.perf_counter() - t0

    def prefill(self, slot: int, piece: list[int], full_logits: bool):
        """Feed `piece` into resident slot `slot`: (the last token's logits, every token's or None)."""
        return self._timed_model("prefill", slot, piece, full_logits)

    def blocks_for_step(self, rows: int) -> int:
        """The most KV blocks the next decode step of batch slots 0..rows-1 takes from the pool:
        speculating, its verify forward's (1 + N tokens for every row it runs, padding rows of a
        graph bucket too: they give theirs back after the step); else one token per row."""
        if self.draft_tokens:
            return self.replica.speculator.blocks_needed(rows)
        return self.batch.blocks_needed(1, rows)

    def decode(self, tokens: list[int]) -> torch.Tensor:
        """One decode step of batch slots 0..len(tokens)-1, each fed its token: logits [B, V]."""
        return self._timed_model("decode", tokens)

    # ------------------------------------------------------------------ the sampler
    def _sampler_write(self, operation: str, *args) -> None:
        """A write to the sampler: every rank's when speculating (each runs the whole step, drafts
        included), else this one's alone (rank 0 samples for all)."""
        if self.draft_tokens:
            self.run(operation, *args)
        else:
            getattr(self.replica, operation)(*args)

    def admit(self, slot: int, req: GenRequest, eos_ids) -> None:
        """`req`'s settings into sampler slot `slot`; the tokens it sent already count (a retry)."""
        params = req.sampling
        if self.draft_tokens and params.seed is None:  # every rank must draw the same noise: one seed, chosen here
            params = dataclasses.replace(params, seed=secrets.randbits(64))
        self._sampler_write("sampler_admit", slot, params, list(req.prompt_ids), list(req.generated),
                            () if req.ignore_eos else tuple(eos_ids))

    def move(self, dst: int, src: int) -> None:
        self._sampler_write("sampler_move", dst, src)

    def release(self, slot: int) -> None:
        self._sampler_write("sampler_release", slot)

    def sample(self, reqs: list[GenRequest], logits: torch.Tensor, slots: list[int] | None = None) -> list:
        """The next token of each request of `reqs` (row i of `logits`, sampler slot `slots[i]` or
        i): a `Drawn`, or the Exception that fails that request alone. Its grammar (if any) has
        consumed the token; `append` must follow with the tokens taken."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self._sample(reqs, logits, slots)
        finally:
            self.cpu_s += time.thread_time() - c0
            self.sampling_s += time.perf_counter() - t0

    def _sample(self, reqs, logits, slots):
        results, remaining, allowed, k = self._prepare(reqs)
        rows = self._draw(logits, allowed, k, slots, results)
        for i, req in enumerate(reqs):
            if results[i] is not None:
                continue
            token, failed, logprob, top_ids, top_lps = rows[i]
            if failed:
                results[i] = SamplingFailed("its logits are not finite (NaN or inf) or its settings allow no token")
                continue
            try:
                if req.constraint is not None:
                    forced = req.constraint.finish(token, remaining[i])
                    if forced != token and req.logprobs is not None:
                        logprob = float(torch.log_softmax(logits[i].float(), dim=-1)[forced])
                    token = forced
            except Exception as e:  # noqa: BLE001
                results[i] = e
                continue
            top = None
            if req.logprobs is not None and req.logprobs > 0:
                top = list(zip(top_ids[:req.logprobs], top_lps[:req.logprobs]))
            results[i] = Drawn(token, logprob if req.logprobs is not None else None, top)
        return results

    def _prepare(self, reqs: list[GenRequest]) -> tuple[list, list[int], torch.Tensor | None, int | None]:
        """What one sampler call for `reqs` needs: per request None or the exception that already
        fails it (its grammar raised), the tokens each may still emit (this one included:
        max_tokens, and the context), the grammar masks [B, V] (None without a constrained
        request) and the logprobs to compute (the most any request asked; None: none)."""
        B = len(reqs)
        results: list = [None] * B
        remaining = [self._remaining(r) for r in reqs]
        allowed = None
        for i, req in enumerate(reqs):
            if req.constraint is not None:
                if allowed is None:
                    allowed = torch.ones(B, self.vocab_size, dtype=torch.bool, device=self.device)
                try:
                    allowed[i] = req.constraint.begin(remaining[i]).to(self.device)
                except Exception as e:  # noqa: BLE001 - this request's grammar: not the batch's
                    results[i] = e
        want = [r.logprobs for r in reqs if r.logprobs is not None]
        return results, remaining, allowed, max(want) if want else None

    def _draw(self, logits, allowed, k, slots, results) -> list:
        """The batched call: per row (token, failed, logprob, top ids, top logprobs). If it raises,
        each row is drawn alone (the same tokens: a row depends on nothing else), so only the rows
        that raise fail (their exception in `results`)."""
        try:
            return self._rows(self.sampler.sample(logits, allowed, k, slots=slots), len(results))
        except Exception:  # noqa: BLE001 - one row's settings or a bug: find the row
            log.warning("engine: the batched sampler raised; drawing row by row", exc_info=True)
        rows = [None] * len(results)
        for i in range(len(results)):
            if results[i] is not None:
                continue
            try:
                out = self.sampler.sample(logits[i:i + 1], None if allowed is None else allowed[i:i + 1], k,
                                          slots=[slots[i] if slots is not None else i])
                rows[i] = self._rows(out, 1)[0]
            except Exception as e:  # noqa: BLE001
                results[i] = e
        return rows

    @staticmethod
    def _rows(out, n: int) -> list:
        # The one read back to the host per step: the tokens (the next step feeds them).
        tokens, failed = out.tokens.tolist(), out.failed.tolist()
        if out.logprob is None:
            return [(tokens[i], failed[i], None, None, None) for i in range(n)]
        lp, ids, tops = out.logprob.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()
        return [(tokens[i], failed[i], lp[i], ids[i], tops[i]) for i in range(n)]

    def append(self, tokens: list[int], slots: list[int] | None = None) -> None:
        """The tokens the rows took: the penalties' history, min_tokens and the noise position move on."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            self._sampler_write("sampler_append", list(tokens), None if slots is None else list(slots))
        finally:
            self.cpu_s += time.thread_time() - c0
            self.sampling_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ speculative decoding
    def join(self, slot: int, first: int, resident_slot: int | None) -> None:
        """Batch slot `slot`, copied from `resident_slot` (None: it decoded plainly), speculates
        after its pending token `first`."""
        self._timed_model("join", slot, first, resident_slot)

    def speculate(self, reqs: list[GenRequest], limits: list[int]) -> list:
        """One speculative step of batch slots 0..len(reqs)-1 (the replica's `speculate`, on every
        rank), request i at most limits[i] tokens: per request (its `Drawn` tokens, the fp32
        logits [k, V] each came from, the drafts proposed), or the Exception that fails it alone
        (logits not finite, its grammar raised). A constrained request (limit 1) gets its
        grammar's mask and closing policy, as in `sample`; `append` must follow with the tokens
        taken (`set_pending` first for one its grammar replaced)."""
        results, remaining, allowed, k = self._prepare(reqs)
        rows = self._timed_model("speculate", limits, allowed, k)
        for i, req in enumerate(reqs):
            tokens, logits, failed, lps, tops, drafted = rows[i]
            if results[i] is not None:
                continue
            if failed:
                results[i] = SamplingFailed("its logits are not finite (NaN or inf) or its settings allow no token")
                continue
            drawn = []
            for j, token in enumerate(tokens):
                logprob = lps[j] if req.logprobs is not None else None
                top = list(zip(*tops[j]))[:req.logprobs] if req.logprobs else None
                drawn.append(Drawn(token, logprob, top))
            if req.constraint is not None:  # limit 1: its one token, closed by its grammar's policy
                try:
                    forced = req.constraint.finish(tokens[0], remaining[i])
                except Exception as e:  # noqa: BLE001
                    results[i] = e
                    continue
                if forced != tokens[0]:
                    if req.logprobs is not None:
                        drawn[0].logprob = float(torch.log_softmax(logits[0].float(), dim=-1)[forced])
                    drawn[0].token = forced
                    self.run("set_pending", req.decode_slot, forced)
            results[i] = (drawn, logits, drafted)
        return results

    def _remaining(self, req: GenRequest) -> int:
        """Tokens `req` may still emit: its max_tokens, and the context."""
        return min(req.max_tokens - len(req.generated), self.ctx + 1 - len(req.prompt_ids) - len(req.generated))

    def limit(self, req: GenRequest) -> int:
        """The most tokens `req` may take from one speculative step: 1 + the drafts, within what it
        may still emit; 1 for a constrained request (its grammar masks one position)."""
        if req.constraint is not None:
            return 1
        return max(1, min(self.draft_tokens + 1, self._remaining(req)))

    def trim(self, used: list) -> None:
        """Batch slots whose request took fewer of the last step's tokens (used[i]; None: all) give the rest back."""
        self.run("trim", used)

    # ------------------------------------------------------------------ prompt logprobs
    @staticmethod
    def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> tuple[list[float], list | None]:
        """Each target's logprob under its row of `logits` [n, V] (row j predicts targets[j]), and the
        k best (token, logprob) of each row when k > 0."""
        lp = torch.log_softmax(logits[:len(targets)].float(), dim=-1)
        chosen = lp.gather(1, torch.tensor(targets, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
        if not k:
            return chosen, None
        vals, idx = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
        return chosen, [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
