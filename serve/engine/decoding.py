"""Decoding: the decode steps of the running requests and what they do with each token.

- `step()`: one batched decode step of every running request (`serve.engine.inflight.InFlight.running`), after
  making the KV pool room for it: plain (one token each, `Runner.decode`) or, with
  `--speculative-tokens N` when the policy (serve.engine.speculation) says so, speculative (each feeds
  its pending token and N drafts in one verify forward and takes 1 to N + 1 tokens; a request
  that ends inside them gives the rest back, `trim`). Checkpoints and periodic snapshots are
  taken between steps, on the batch slot (serve.engine.sessions).
- `start(req, logits)`: a request whose prompt is in its session samples its first token and
  joins the batch (its settings written once into its sampler slot, which moves with it).
- `sample` / `take`: one batched sampler call (serve.engine.runner), then each token recorded in its
  request and handed to the output part; `take` decides whether it ends the request (EOS, a stop
  token, its grammar done, its budget or the context) and starts a grammar after its trigger.
- `trim_at_stops`: speculating, a stop string the output part found inside the last step's
  tokens gives back the tokens past it, so the session holds what plain decoding would have fed.

Sampling is one `BatchSampler` call per step for the whole batch (grammar masks, penalties, bias,
bans, filters, logprobs); seeded draws are Gumbel-max over noise hashed from (seed, token index,
token id), so a request's tokens do not depend on what else is in the batch. The step's token ids
are the one thing read back to the host. A request with a grammar (`GenRequest.grammar`, or
`after_trigger` once it takes its trigger token) has each sample masked and its value closed
before its budget ends; it ends ("stop") when nothing can follow. `max_tokens` 0: nothing is
sampled ("length").

A step that raises (device error, OOM, injected fault) goes to `failed` (serve.engine.recovery); what
raises for one request alone (sampling, its grammar, its settings) fails that request
(`own_failure`) and the batch goes on. The runner, sessions and requests in flight (serve.engine.inflight)
are the engine's, handed in, with its `end(req, outcome)`, `failed(reqs, error, stage)` and `hand(record)`.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ds4_torch.faults import fault_point

from serve.errors import APIError
from .sequence import GenRequest, Token
from .speculation import SpeculationPolicy

log = logging.getLogger("ds4.serve")


class Decoding:
    def __init__(self, runner, sessions, in_flight, metrics, *, ctx: int, eos_ids, draft_tokens: int,
                 speculation: SpeculationPolicy, end: Callable, failed: Callable, hand: Callable):
        self.runner, self.sessions, self.in_flight, self.metrics = runner, sessions, in_flight, metrics
        self.ctx = ctx
        self.eos_ids = eos_ids
        self.end, self.failed, self.hand = end, failed, hand
        self.draft_tokens = draft_tokens
        self.spec_totals = [0, 0]  # verify steps (per sequence), tokens they emitted: the acceptance length
        # Which decode steps speculate: at most `speculative_max_batch` sequences, and with "auto"
        # the kind measured faster. After plain steps each row's speculation state is stale until
        # it joins again (`rejoin`).
        self.speculation = speculation
        self.rejoin: set[GenRequest] = set()
        # The last speculative step's tokens per request that goes on: (generated before it,
        # tokens it took, their logits [k, V], held before it), so a stop string the output part
        # finds among them can give the rest back (`trim_at_stops`).
        self.last_step: dict[GenRequest, tuple[int, int, torch.Tensor, int]] = {}
        self.decode_rows = 0        # sequences x decode steps
        self.token_delay = 0.0      # test hook: seconds slept after each decode step

    def step(self) -> None:
        """One decode step of every running request (after making the KV pool room for it): plain,
        or speculative when the policy says so."""
        self.in_flight.room_for_step()
        if not self.in_flight.running:
            return
        self.last_step = {}
        if not self.draft_tokens:
            self._plain()
            return
        rows, model_s = len(self.in_flight.running), self.runner.model_s
        measuring = self.speculation.policy == "auto"  # "always" needs no timings
        generated = sum(len(r.generated) for r in self.in_flight.running) if measuring else 0
        speculative = self.speculation.speculate(rows)
        fair = not (speculative and self.rejoin & set(self.in_flight.running))
        if speculative:
            reqs = list(self.in_flight.running)
            self._speculative()
        else:
            self.rejoin = set(self.in_flight.running)  # a plain step: their drafts start over when speculation resumes
            reqs = list(self.in_flight.running)
            self._plain()
        if measuring:
            tokens = sum(len(r.generated) for r in reqs) - generated
            self.speculation.record(rows, speculative, tokens, self.runner.model_s - model_s, fair)

    def _plain(self) -> None:
        reqs = list(self.in_flight.running)
        try:
            if any(r.session.restored is not None for r in reqs):
                fault_point("restore")
            logits = self.runner.decode([r.pending for r in reqs])
        except BaseException as e:  # noqa: BLE001 - device errors, OOM, injected faults, bugs
            self.failed(reqs, e, "decode")
            return
        self.metrics.batch_size.observe(len(reqs))
        self.decode_rows += len(reqs)
        for req in reqs:
            self.sessions.confirm_restored(req.session)
            req.held.append(req.pending)
        finishes = self.sample(reqs, logits)
        done = []
        for i, req in enumerate(reqs):
            if finishes[i] is not None:
                done.append(req)
                continue
            boundary = self.sessions.wanted(req, len(req.held))
            if boundary is not None:  # between steps, on its batch slot: joins the session when it leaves
                self.sessions.take_or_skip(req.session, "batch", req.decode_slot, len(req.held), logits[i], boundary,
                                           pending=True)
            self.sessions.snapshot_if_due(req.session, req.decode_slot, req.held, req.logits)
        for req in sorted(done, key=lambda r: -r.decode_slot):
            self.end(req, "failed" if req.failure is not None else "done")
        if self.token_delay:
            time.sleep(self.token_delay)

    def _speculative(self) -> None:
        """One speculative step (`--speculative-tokens N`) of every decoding request: each feeds
        its pending token and N drafts in one verify forward and takes the tokens plain decoding
        would have given (1 to N + 1; a constrained request one). Each token goes through `take`
        as in a plain step; a request that ends inside its tokens gives the rest back to the cache
        (`trim`), so its session holds what plain decoding would have fed."""
        reqs = list(self.in_flight.running)
        try:
            if any(r.session.restored is not None for r in reqs):
                fault_point("restore")
            for req in reqs:
                if req in self.rejoin:  # after plain steps: its MTP layer skips what they fed
                    self.runner.join(req.decode_slot, req.pending, None)
            self.rejoin.clear()
            results = self.runner.speculate(reqs, [self.runner.limit(r) for r in reqs])
        except BaseException as e:  # noqa: BLE001 - device errors, OOM, injected faults, bugs
            self.failed(reqs, e, "decode")
            return
        self.metrics.batch_size.observe(len(reqs))
        self.decode_rows += len(reqs)
        done, used, taken, slots, counted, counts, going_on = [], [], [], [], [], [], []
        for req, result in zip(reqs, results):
            self.sessions.confirm_restored(req.session)
            before = len(req.held)
            req.held.append(req.pending)  # fed by the verify forward
            if isinstance(result, BaseException):
                self.own_failure(req, result, "sampling")
                req.pending = None
                done.append(req)
                used.append(None)
                continue
            drawn, rows, drafted = result
            generated_before = len(req.generated)
            end = None
            free = req.constraint is None
            for j, d in enumerate(drawn):
                if j:
                    req.held.append(drawn[j - 1].token)  # an accepted draft: fed too
                req.logits = rows[j]
                end = self.take(req, d)
                taken.append(d.token)
                slots.append(req.decode_slot)
                if end is not None:
                    break
                if free and req.constraint is not None:
                    # Its grammar starts after this token: the step's later tokens were not masked
                    # by it, so they go back; its drafts start over (`rejoin`).
                    self.rejoin.add(req)
                    break
            used.append(j + 1 if j + 1 < len(drawn) else None)
            counted.append(req)
            counts.append((drafted, len(drawn) - 1))
            if end is not None:
                done.append(req)
                continue
            self.last_step[req] = (generated_before, j + 1, rows, before)
            going_on.append((req, before))
        self._count_drafts(counted, counts)
        try:
            if any(u is not None for u in used):
                self.runner.trim(used)
            self.runner.append(taken, slots)
        except BaseException as e:  # noqa: BLE001 - the batch's state is unknown: retry the others
            for req in done:  # ended already: answered, their sessions dropped (their slots are unknown)
                self.runner.release(req.decode_slot)
                self.in_flight.forget(req)
                self.end(req, "failed" if req.failure is not None else "done")
            self.in_flight.running = [r for r in self.in_flight.running if r not in done]
            self.failed([r for r in reqs if r not in done], e, "decode")
            return
        # Checkpoints and snapshots read the slot once the step's tokens past what each request
        # took are given back (a grammar starting after its trigger): the slot then holds
        # exactly `held`, the position they are registered at.
        for req, before in going_on:
            boundary = self.sessions.wanted_between(req, before, len(req.held))
            if boundary is not None:
                self.sessions.take_or_skip(req.session, "batch", req.decode_slot, len(req.held), req.logits,
                                           boundary, pending=True)
            self.sessions.snapshot_if_due(req.session, req.decode_slot, req.held, req.logits)
        for req in sorted(done, key=lambda r: -r.decode_slot):
            self.end(req, "failed" if req.failure is not None else "done")
        if self.token_delay:
            time.sleep(self.token_delay)

    def _count_drafts(self, reqs: list[GenRequest], counts: list[tuple[int, int]]) -> None:
        """Each request's drafts proposed and accepted in this step: its own counts and /metrics."""
        for req, (drafted, accepted) in zip(reqs, counts):
            req.draft_tokens += drafted
            req.accepted_drafts += accepted
        drafted, accepted = sum(c[0] for c in counts), sum(c[1] for c in counts)
        self.spec_totals[0] += len(counts)
        self.spec_totals[1] += len(counts) + accepted
        m = self.metrics
        m.spec_steps.inc(len(counts))
        m.spec_drafted.inc(drafted)
        m.spec_accepted.inc(accepted)
        m.spec_emitted.inc(len(counts) + accepted)
        m.spec_acceptance.set(self.spec_totals[1] / self.spec_totals[0])

    def sample(self, reqs: list[GenRequest], logits, slots: list[int] | None = None) -> list[str | None]:
        """The next token of every request of `reqs` (row i of `logits`, sampler slot `slots[i]`
        or i), from one batched sampler call (serve.engine.runner); each token recorded in its request
        and handed to the output part. Per request: None (it goes on), "end" (it is done) or
        "error" (its own failure, `req.failure` set; the caller ends it, the batch goes on)."""
        drawn = self.runner.sample(reqs, logits, slots)
        results: list[str | None] = []
        taken = []
        for i, (req, d) in enumerate(zip(reqs, drawn)):
            if isinstance(d, BaseException):
                self.own_failure(req, d, "sampling")
                req.pending = None
                results.append("error")
                taken.append(0)
                continue
            req.logits = logits[i]
            results.append(self.take(req, d))
            taken.append(d.token)
        try:  # the history the penalties, min_tokens and the noise position see
            self.runner.append(taken, slots)
        except Exception as e:  # noqa: BLE001 - a bug: these rows' histories are now unknown
            for i, req in enumerate(reqs):
                if results[i] is None:
                    self.own_failure(req, e, "recording its token")
                    results[i], req.pending = "error", None
        return results

    def take(self, req: GenRequest, d) -> str | None:
        """`req` takes its token (`d`, a serve.engine.runner.Drawn); it goes to the output part. "end"
        when it ends the request."""
        token = d.token
        req.generated.append(token)
        c = req.constraint
        if c is not None and req.after_trigger is not None and c.done:
            # Its block closed: the reply goes on free, to the EOS the model writes (so a valid
            # call leaves the model's own tokens as they were), or to another block.
            req.constraint = c = None
        # A constrained request's EOS ends it even with ignore_eos: its grammar allows nothing after.
        if token in req.sampling.stop_token_ids or (token in self.eos_ids and (not req.ignore_eos or c is not None)):
            end = "eos"
        elif c is not None and c.done or token in req.stop_tokens:  # nothing can follow / its text is a stop
            end = "stop"
        # Feeding this token back needs room for the whole sequence in the context.
        elif len(req.generated) >= req.max_tokens or len(req.prompt_ids) + len(req.generated) > self.ctx:
            end = "length"
        else:
            end = None
        self.hand(Token(req, token, end, d.logprob, d.top))
        req.pending = None if end is not None else token
        if end is None and c is None and req.after_trigger is not None and token == req.after_trigger.trigger:
            self.arm(req)
        return None if end is None else "end"

    @staticmethod
    def arm(req: GenRequest) -> None:
        """`req` took its trigger token: from its next token on, its output follows the grammar
        (until the grammar is done: `take`)."""
        try:
            req.constraint = req.after_trigger.grammar.constraint()
        except Exception as e:  # noqa: BLE001 - the text goes on unconstrained, as without one
            log.warning("engine: %s: the grammar after its trigger token failed to start: %s", req.id, e)

    @staticmethod
    def own_failure(req: GenRequest, error: BaseException, doing: str) -> None:
        """`req` fails alone (a 500 naming `error`): the caller ends it, the batch goes on."""
        log.error("engine: %s failed while %s", req.id, doing, exc_info=error)
        req.failure = APIError(500, f"this request failed in the engine while {doing} ({type(error).__name__}: "
                                    f"{error}); other requests were not affected", code="internal_error")

    def start(self, req: GenRequest, logits, prefilled: bool) -> None:
        """The prompt is in the session: sample the first token, then join the batch (its batch
        slot, and its sampler slot, the next free one)."""
        session = req.session
        if req.cancel.is_set():
            self.end(req, "cancelled", stage="prefill")
            return
        if req.max_tokens <= 0:  # the prompt only (its logprobs): nothing to sample
            self.end(req, "done", reason="length")
            return
        slot = len(self.in_flight.running)
        try:  # its settings, written once
            self.runner.admit(slot, req, self.eos_ids)
        except Exception as e:  # noqa: BLE001 - this request's settings or a bug: not the engine's
            self.runner.release(slot)
            self.own_failure(req, e, "starting")
            self.end(req, "failed")
            return
        finish = self.sample([req], logits.reshape(1, -1), slots=[slot])[0]
        if finish is not None:
            self.runner.release(slot)
        if finish == "error":
            self.end(req, "failed")
            return
        if prefilled:  # once the first token is out, the prompt is worth a snapshot
            self.sessions.snapshot(session, self.runner.resident.slot(session.slot), session.tokens, logits, "prefill")
        if finish is not None:
            self.end(req, "done")
            return
        try:
            self.runner.run("copy", "batch", slot, session.slot, "resident")
            if self.draft_tokens:  # its first draft, from where its prefill left the MTP layer
                self.runner.join(slot, req.pending, session.slot)
        except BaseException as e:  # noqa: BLE001
            self.runner.run("reset", "batch", slot)
            self.runner.release(slot)
            self.failed([req], e, "admit")
            return
        self.in_flight.join(req, slot)

    def trim_at_stops(self, stopped: list[GenRequest]) -> None:
        """Speculating, a stop string the output part found among the last step's tokens of a
        request: that step's tokens past the one completing it are given back (`trim`), so its
        session holds what plain decoding, which meets the stop a token at a time, would have
        fed: every token up to the stop's last one (which is the reply's last, not fed)."""
        used, cut = [None] * len(self.in_flight.running), []
        for req in stopped:
            info = self.last_step.get(req)
            if info is None or req.stop_at is None:
                continue
            generated_before, taken, rows, held_before = info
            k = req.stop_at - generated_before  # the step's tokens up to and including the stop's last
            if 1 <= k < taken:
                used[req.decode_slot] = k
                cut.append((req, k, rows, held_before))
        self.last_step = {}
        if not cut:
            return
        try:
            self.runner.trim(used)
        except BaseException as e:  # noqa: BLE001 - keep what was fed, as after a lagging stop
            log.warning("engine: could not give back the tokens past a stop string: %s: %s", type(e).__name__, e)
            return
        for req, k, rows, held_before in cut:
            del req.held[held_before + k:]
            req.logits = rows[k - 1]

