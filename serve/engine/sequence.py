"""One request's state: the only type the engine's parts share (with the records of what happened
to it that the engine hands the output part: `Token`, `End`, `PromptLogprobs`, `Started`).

A `GenRequest` is made by the API layer (prompt, budget, sampling settings, stops, how events
reach its client) and carried through the engine's parts: sessions (`serve.engine.sessions`: which
resident slot holds its prefix), the scheduler (`serve.engine.scheduler`: when it runs), the runner
(`serve.engine.runner`: its rows in the model step and the batched sampler) and the output part
(`serve.engine.output`: its token ids become text, stop strings, events). Each part writes only its own
fields (named below by section); the parts import this module and lower ones, never each other.

Events reach the client through `GenRequest.emit`, always from the output part's thread, in order:
``("prompt_logprobs", [TokenOut])`` (once, before the first token, when asked for),
``("token", TokenOut)``, then one of ``("done", finish_reason)``, ``("error", APIError)``,
``("cancelled", stage)``. When the end event is emitted every field the client reads
(`generated`, `text`, `finish_reason`, `cumulative_logprob`, timings) is final.
"""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ds4_torch.sampling import SamplingParams


@dataclass
class TokenOut:
    token_id: int
    text: str                          # text this token releases (may be "" while held back)
    logprob: float | None = None       # raw log-softmax of the model (None for a prompt's first token)
    top: list[tuple[int, float]] | None = None


@dataclass(eq=False)
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    ignore_eos: bool = False
    prompt_logprobs: int | None = None   # k: each prompt token's logprob and its k best (event "prompt_logprobs")
    grammar: Any = None                  # a ds4_torch.structured.Grammar: the output follows it
    # A ds4_torch.structured.Triggered: once its token is taken, what follows keeps to its grammar
    # until the grammar is done (the calls of a tool-call block name offered tools); free otherwise.
    after_trigger: Any = None
    tenant: Any = None                   # who asked (the API key): prefix reuse never crosses tenants
    boundaries: tuple[int, ...] = ()     # prompt positions worth a checkpoint (message ends, client hints)
    emit: Callable[[tuple], None] = lambda event: None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    cancel: threading.Event = field(default_factory=threading.Event)
    # What the client reads (final once the end event is out). `generated` is written by the
    # engine as tokens are sampled; a stop string found later cuts it back (the output part).
    generated: list[int] = field(default_factory=list)
    text: str = ""
    cached_tokens: int = 0
    # What it reused and why not more (serve.engine.reuse), from its first admission on (with `cached_tokens`).
    cache_report: dict | None = None
    prefilled_tokens: int = 0          # tokens run through prefill (recomputed), retries included
    prefill_chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None
    attempts: int = 0
    prompt_logprob_outs: list[TokenOut] | None = None   # once computed (also sent as an event)
    draft_tokens: int = 0              # speculative decoding: drafts proposed and accepted for this request
    accepted_drafts: int = 0
    cumulative_logprob: float = 0.0    # sum of the generated tokens' logprobs, when `logprobs` is set (best_of)
    state: str = "new"                 # new, queued, running, done, cancelled, failed
    t_arrival: float = field(default_factory=time.perf_counter)
    t_start: float | None = None
    t_first: float | None = None
    t_last: float | None = None        # when the last token went out (inter-token latency)
    t_end: float | None = None
    # The engine's bookkeeping while the request runs (engine thread only).
    ended: bool = field(default=False, repr=False)              # its end was handed to the output part
    session: Any = field(default=None, repr=False)              # its serve.engine.sessions.Session
    decode_slot: int | None = field(default=None, repr=False)   # its batch (and sampler) slot while decoding
    held: list[int] = field(default_factory=list, repr=False)   # tokens its batch slot holds
    pending: int | None = field(default=None, repr=False)       # sampled, to be fed by the next step
    logits: torch.Tensor | None = field(default=None, repr=False)
    no_restore: bool = field(default=False, repr=False)         # a disk restore failed: prefill cleanly
    disk: Any = field(default=None, repr=False)                 # its disk state read off the engine thread:
                                                                # a LoadedSnapshot, False for a miss, None: not read
    constraint: Any = field(default=None, repr=False)           # the grammar's state for this request
    stop_tokens: frozenset = field(default=frozenset(), repr=False)  # tokens whose text alone is a stop string
    plp: list[TokenOut] | None = field(default=None, repr=False)  # prompt logprobs collected so far
    failure: Any = field(default=None, repr=False)              # its own APIError, once it raised
    # Written by the output part (its thread), read by the engine between steps.
    text_state: Any = field(default=None, repr=False)           # serve.engine.output.TextState
    emitted: int = field(default=0, repr=False)                 # tokens turned into events so far
    stop_at: int | None = field(default=None, repr=False)       # a stop string ended the text at this token
    stop_found: threading.Event = field(default_factory=threading.Event, repr=False)  # the engine ends it

    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and self.prompt_logprob_outs is None

    def finished(self) -> bool:
        return self.state in ("done", "cancelled", "failed")

    def sequence(self) -> list[int]:
        """Everything the model must have seen before the next token: prompt and tokens sampled."""
        return self.prompt_ids + self.generated


# ------------------------------------------------------------------ what the engine hands the output part
# Once per iteration, in the order they happened (serve.engine.output turns them into events).
@dataclass
class Token:
    """One sampled token of `req`. `end`: what the engine ended it with (None: it goes on;
    "eos": an EOS or stop token id, whose text is not output; "stop": its grammar is complete, or its
    text alone is one of its stop strings;
    "length": its budget or the context is spent). `logprob`/`top`: when it asked for them."""
    req: GenRequest
    token: int
    end: str | None
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    sampled_at: float = 0.0


@dataclass
class End:
    """`req` ended: "done" (its finish reason from its tokens, or `reason`), "failed" (`error`, an
    APIError) or "cancelled" (`stage`)."""
    req: GenRequest
    outcome: str
    reason: str | None = None
    error: Any = None
    stage: str = "decode"


@dataclass
class PromptLogprobs:
    req: GenRequest
    outs: list[TokenOut]


@dataclass
class Started:
    """`req` was admitted (its `cached_tokens`, `cache_report` and `t_start` are known): nothing to
    do in this process; an engine core in another process sends it on (serve.core.process)."""
    req: GenRequest
