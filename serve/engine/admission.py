"""Admission and prefill: requests leave the queue, take a session, and have their prompt fed.

`step()`, once per iteration when a batch slot is free (and no decode step had to preempt):
the scheduler's next request takes a session (serve.engine.sessions: what it reuses, a session's end
or a checkpoint), then its prompt is prefilled in place, in its session's resident slot, at most
one chunk (`prefill_chunk` tokens) per iteration, so a long prompt delays the running streams by
at most one chunk per token. A chunk ends where a checkpoint is due, and the checkpoint is taken
right after it. Once the prompt is in, the request samples its first token and joins the batch
(`start_decoding`, serve.engine.decoding). The requests queued right behind it with the same sequence
(the choices of an `n` > 1 request) are admitted at once, each forking that session, so the
prompt is prefilled once.

Prompt logprobs come from the full logits of the request's own prefill chunks (so chunked and
cancellable like any prefill); such a request reuses no prefix (serve.engine.sessions).

The scheduler, sessions, runner and requests in flight (serve.engine.inflight) are the engine's, handed in, with its
`start_decoding(req, logits, prefilled)`, `failed(reqs, error, stage)` and `hand(record)`.
"""
from __future__ import annotations

import time
from typing import Callable

from ds4_torch.faults import fault_point

from .sequence import GenRequest, PromptLogprobs, Started, TokenOut


class Admission:
    def __init__(self, scheduler, sessions, runner, in_flight, metrics, *, prefill_chunk: int,
                 start_decoding: Callable, failed: Callable, hand: Callable):
        self.scheduler, self.sessions, self.runner, self.in_flight = scheduler, sessions, runner, in_flight
        self.metrics = metrics
        self.prefill_chunk = prefill_chunk
        self.start_decoding, self.failed, self.hand = start_decoding, failed, hand
        self.chunks_run = 0
        self.chunk_delay = 0.0  # test hook: seconds slept after each prefill chunk

    def step(self) -> None:
        """Admit the next request if there is room, then feed one chunk of the prompt prefilling."""
        req = self.in_flight.prefilling
        if req is None:
            if self.in_flight.full() or (self.in_flight.pool_short and self.in_flight.running):
                return
            req = self.scheduler.next_waiting()
            if req is None:
                return
            seq = req.sequence()
            if not self.admit(req):  # its session held its whole sequence: it is decoding already
                self.admit_same_sequence(seq)
                return
        session = req.session
        seq = req.sequence()
        start = len(session.tokens)
        # A chunk ends where a checkpoint is due: its end state is the checkpoint's.
        piece = seq[start:self.sessions.next_stop(req, start, min(len(seq), start + self.prefill_chunk))]
        need = self.runner.resident.table(session.slot).blocks_needed(len(piece))
        if not self.sessions.make_room(need, (session,)):
            return  # the pool is held by decoding requests: this prompt waits (they end, or are preempted)
        try:
            if session.restored is not None:
                fault_point("restore")
            # every: the chunk's full logits, for prompt logprobs
            logits, every = self.runner.prefill(session.slot, piece, req.wants_prompt_logprobs())
            if every is not None:
                self._collect_prompt_logprobs(req, start, every)
        except BaseException as e:  # noqa: BLE001 - device errors, OOM, injected faults, bugs
            self.failed([req], e, "prefill")
            return
        self.sessions.confirm_restored(session)
        self.sessions.extend(session, piece, logits)
        req.prefill_chunks += 1
        req.prefilled_tokens += len(piece)
        boundary = self.sessions.wanted(req, len(session.tokens))
        if boundary is not None:
            self.sessions.take_or_skip(session, "resident", session.slot, len(session.tokens), logits, boundary)
        self.metrics.prefill_chunks.inc()
        self.chunks_run += 1
        if self.chunk_delay:
            time.sleep(self.chunk_delay)
        if len(session.tokens) == len(seq):
            self.in_flight.prefilling = None
            self.start_decoding(req, logits, prefilled=True)
            self.admit_same_sequence(seq)

    def admit_same_sequence(self, seq: list[int]) -> None:
        """Admit the requests queued right behind one whose sequence `seq` is now in a session and
        that ask for the same sequence (the choices of an `n` > 1 request): each forks that
        session now, before a decode step can extend it, so the prompt is prefilled once."""
        while self.in_flight.prefilling is None and not self.in_flight.full():
            req = self.scheduler.next_with_sequence(seq)
            if req is None:
                return
            self.admit(req)

    def _collect_prompt_logprobs(self, req: GenRequest, start: int, logits) -> None:
        """Prompt logprobs from a chunk's logits [chunk, V] (row j, at position start + j, predicts
        the token at start + j + 1); handed to the output part once the whole prompt is in."""
        prompt, k = req.prompt_ids, req.prompt_logprobs
        if start == 0:
            req.plp = [TokenOut(prompt[0], "")]  # nothing predicts the first token
        end = min(start + logits.shape[0], len(prompt) - 1)  # the last prompt position predicted here
        if end > start:
            targets = prompt[start + 1:end + 1]
            chosen, tops = self.runner.prompt_logprobs(logits, targets, k)
            for j, token in enumerate(targets):
                req.plp.append(TokenOut(token, "", chosen[j], tops[j] if k else None))
        if len(req.plp) == len(prompt):  # each token's text is the output part's
            req.prompt_logprob_outs, req.plp = req.plp, None
            self.hand(PromptLogprobs(req, req.prompt_logprob_outs))

    def admit(self, req: GenRequest) -> bool:
        """Start `req`: a session, then either its prefill (True) or, when the session already
        holds its whole sequence, its first token (False)."""
        req.state = "running"
        if req.t_start is None:
            req.t_start = time.perf_counter()
        if req.attempts == 0:
            req.attempts = 1
        try:
            reused = self.sessions.claim(req)
        except BaseException as e:  # noqa: BLE001 - a copy between slots failed (device error)
            self.failed([req], e, "admit")
            return False
        if req.attempts == 1 and not req.generated:
            req.cached_tokens = reused
        self.hand(Started(req))
        if reused < len(req.sequence()):
            self.in_flight.prefilling = req
            return True
        self.start_decoding(req, req.session.last_logits, prefilled=False)
        return False
