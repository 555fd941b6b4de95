"""Decode paths: eager, captured graphs replayed step after step, and torch.compile.

`make_decoder(model, cache, mode)` returns a decoder whose `.step(ids[B]) -> logits[B, V]`
consumes one token per sequence and advances the cache. The graph path captures the model's
decode step once per batch size and replays it. That is only correct because everything
position-dependent in the step is read from tensors (`cache.positions`) and the cache never
reallocates; the capture backends make that checkable:

- `cuda`: `torch.cuda.CUDAGraph` over the static buffers, in a private memory pool.
- `emulator` (every other device): the step is traced once with `make_fx` over the very same
  static buffers and the FX graph is replayed. Tracing runs on real tensors, so any Python value
  read at capture time (an `.item()`, an `int(...)`, a branch) is frozen into the graph exactly
  as a CUDA graph would freeze it, and shows up here as a divergence from eager.

`compile` runs each step through `torch.compile(model, fullgraph=True)` (inductor): the first step
compiles (a minute or more on a CPU), later ones run the fused code.

`auto` (`choose_mode`) picks, per device, the mode that decodes a request fastest counting its
first step: graph on CUDA; eager elsewhere, because the emulator only replays the same ops and
a compile (seconds to minutes at the first step) pays for itself only over long runs, if at all
(`ds4-torch bench decode` measures all three and the break-even point; ask for `compile`
explicitly where a process decodes that long).

A failure during a step (a device error, an OOM, or one injected with `DS4_TORCH_FAULT`)
drops every captured graph, marks the batch's sequences invalid in the cache (they must be reset
before reuse) and re-raises: nothing that could poison a later request survives.
"""

from __future__ import annotations

import os
import threading

import torch

from .cache import DS4Cache, Rollback
from .hardware import capabilities
from .faults import fault_point

MODES = ("auto", "eager", "graph", "compile")
ENV = "DS4_TORCH_DECODE_MODE"


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so asynchronous errors surface here, inside our handling."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def choose_mode(device) -> tuple[str, str]:
    """The mode `auto` runs on `device`, and why."""
    caps = capabilities(device)
    if caps.cuda_graphs:
        return "graph", "CUDA graphs: each decode step is one graph replay instead of a kernel launch per op"
    compile_note = ("torch.compile works here, but its first step compiles (seconds to minutes), repaid only "
                    "if its steps are faster, over enough tokens (`ds4-torch bench decode` measures both; ask for "
                    "mode 'compile' in a long-lived process)" if caps.compile
                    else f"torch.compile is unavailable ({caps.compile.reason})")
    return "eager", (f"no CUDA graphs ({caps.cuda_graphs.reason}); the capture emulator replays the same ops, "
                     f"no faster than eager; {compile_note}")


def resolve_mode(mode: str, device) -> str:
    mode = os.environ.get(ENV) or mode
    if mode not in MODES:
        raise ValueError(f"unknown decode mode {mode!r} (from {ENV} or the argument); modes: {', '.join(MODES)}")
    if mode == "auto":
        return choose_mode(device)[0]
    return mode


def align_mtp(cache: DS4Cache, b: int, behind: int = 0) -> None:
    """Put sequence b's MTP layer `behind` positions behind where its main layers stand: a layer
    ahead of that is reset (its rows would belong to other tokens), one behind it moves up (it
    skips the positions it lacks). Either only costs drafts: speculation's output depends on the
    main layers alone. Reads positions on the host: between steps, never inside one."""
    mtp_cache = cache.mtp
    held, target = int(mtp_cache.positions[b]), max(int(cache.positions[b]) - behind, 0)
    if held > target:
        mtp_cache.reset(b)
    if held != target:
        mtp_cache.positions[b] = target


def prefill(model, cache: DS4Cache, input_ids: torch.Tensor, chunk: int = 256, on_chunk=None,
            full_logits: bool = False, mtp: bool = False, carry: torch.Tensor | None = None):
    """Feed `input_ids` [B, T] through the cache in chunks of `chunk` tokens; return the logits of
    the last token fed [B, V]. `on_chunk(tokens_done, logits)` runs after each chunk (`logits`: the
    chunk's last token's, [B, V]; with `full_logits`, every token's of the chunk, [B, chunk, V], for
    prompt logprobs): returning False stops early (the prefix fed so far stays valid in the cache)
    and `prefill` returns None. The one chunked prefill loop: `generate()`, the server's engine and
    the tests all feed prompts through it.
    A failing chunk invalidates the batch's sequences and re-raises.
    `mtp`: also feed the model's MTP layer (`cache.mtp`) every position but the last (its input at
    position p is the hidden streams at p and token p+1: the last one waits for the sampled
    token), and return (logits, the last token's hidden streams [B, 1, n, H]): what speculative
    decoding starts from, and what a later call continuing the same sequences takes as `carry`
    (so the MTP layer is fed that last position too, instead of skipping it)."""
    if chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
    B, T = input_ids.shape
    cache.check_usable(B)
    cache.check_room(T, B)
    target = cache.narrow(B)
    logits = last_streams = None
    if mtp:  # the MTP layer starts where this call feeds it: one behind with a carried position
        for b in range(B):
            align_mtp(target, b, behind=0 if carry is None else 1)
        last_streams = carry
    for a in range(0, T, chunk):
        try:
            with torch.inference_mode():  # no autograd bookkeeping per op (transformers' generate does the same)
                # Only the last token's logits unless the caller wants every token's (prompt logprobs).
                keep = 0 if full_logits else 1
                every = (model(input_ids[:, a:a + chunk], cache=target, logits_to_keep=keep, return_streams=True)
                         if mtp else model(input_ids[:, a:a + chunk], cache=target, logits_to_keep=keep))
                if mtp:
                    every, streams = every
                    # MTP positions a-1 .. a+c-2: the previous chunk's last streams join this one's.
                    fed = streams[:, :-1] if last_streams is None else torch.cat([last_streams, streams[:, :-1]], 1)
                    if fed.shape[1]:
                        first = a if last_streams is not None else a + 1  # the token after each fed position
                        model.mtp_forward(fed, input_ids[:, first:a + chunk], target, logits_to_keep=1)
                    last_streams = streams[:, -1:].clone()
            logits = every[:, -1].clone()  # a normal tensor: callers may update it in place
            fault_point("prefill")  # (where an asynchronous device error surfaces: the forward ran)
            synchronize(cache.device)
        except BaseException:
            cache.invalidate(range(B))
            raise
        if on_chunk is not None and on_chunk(min(a + chunk, T), every if full_logits else logits) is False:
            return None if a + chunk < T else logits
    return (logits, last_streams) if mtp else logits


def make_decoder(model, cache: DS4Cache, mode: str = "auto", scratch_padding: bool = False) -> "Decoder":
    """A decoder for `model` over `cache`; env DS4_TORCH_DECODE_MODE overrides `mode`.

    `scratch_padding`: the caller keeps the sequences a step uses first, and every row past them
    is scratch (holds nothing it needs). Graph mode then captures one graph per power-of-two
    batch bucket (1, 2, 4, ...; at most the cache's batch) and pads each step with scratch rows,
    instead of one graph per batch size."""
    resolved = resolve_mode(mode, cache.device)
    if resolved == "graph":
        return GraphDecoder(model, cache, scratch_padding=scratch_padding)
    if resolved == "compile":
        return CompiledDecoder(model, cache)
    return EagerDecoder(model, cache)


class Decoder:
    mode = "eager"

    def __init__(self, model, cache: DS4Cache):
        self.model, self.cache = model, cache

    def _check(self, input_ids: torch.Tensor) -> int:
        if input_ids.dim() != 1 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"step expects token ids of shape [batch] (int64), got {tuple(input_ids.shape)} "
                             f"{input_ids.dtype}")
        n = input_ids.shape[0]
        if not 1 <= n <= self.cache.batch_size:
            raise ValueError(f"step got {n} tokens but the cache holds {self.cache.batch_size} sequences")
        self.cache.check_usable(n)
        self.cache.narrow(n).take_tokens(input_ids.view(n, 1))
        self.cache.check_room(1, n)
        return n

    def _eager_step(self, input_ids, n):
        with torch.inference_mode():  # no autograd bookkeeping per op (transformers' generate does the same)
            logits = self.model._forward(input_ids.view(n, 1), self.cache.narrow(n))[:, 0]
        return logits.clone()  # a normal tensor: callers may update it in place

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        n = self._check(input_ids)
        try:
            logits = self._step(input_ids.to(self.cache.device), n)
            fault_point("decode")  # (where an asynchronous device error surfaces: the step ran)
            synchronize(self.cache.device)
        except BaseException:
            self._fail(n)
            raise
        self.cache.narrow(n).commit_tokens()
        return logits

    def _step(self, input_ids, n):
        return self._eager_step(input_ids, n)

    def _fail(self, n: int) -> None:
        self.cache.invalidate(range(n))
        self.reset()

    def reset(self) -> None:
        """Drop whatever was captured (nothing, for eager)."""


class EagerDecoder(Decoder):
    mode = "eager"


class CompiledDecoder(Decoder):
    """Steps through `torch.compile(model, fullgraph=True)`: one graph per batch size, compiled at
    its first step (the cache's tensors are inputs, so the graph serves every position)."""

    mode = "compile"

    def __init__(self, model, cache: DS4Cache):
        super().__init__(model, cache)
        self.compiled = torch.compile(model, fullgraph=True)

    def _step(self, input_ids, n):
        with torch.inference_mode():
            logits = self.compiled(input_ids.view(n, 1), cache=self.cache.narrow(n))[:, 0]
        return logits.clone()  # a normal tensor: callers may update it in place


class _Captured:
    """One captured decode step for a batch size: static input ids, static logits, replay()."""

    def __init__(self, decoder: "GraphDecoder", n: int):
        self.n = n
        cache = decoder.cache.narrow(n)
        self.buffers = [t.data_ptr() for t in cache.tensors()]
        self.ids = torch.zeros(n, dtype=torch.long, device=cache.device)
        snapshot = [t.clone() for t in cache.tensors()]
        model = decoder.model

        def step(ids, *state):  # `state` are the cache's tensors: graph inputs, not constants
            return model._forward(ids.view(n, 1), cache)[:, 0]

        self.inputs = [self.ids, *cache.tensors()]
        try:
            if cache.device.type == "cuda":
                self._capture_cuda(step, decoder.pool)
            else:
                self.ids.copy_(decoder.warmup_ids(n))
                self.graph = emulate_capture(step, self.inputs)
                self.logits = None
        finally:
            # Capture ran (emulator) or warmed up (CUDA) the step on the live state: put it back.
            for t, saved in zip(cache.tensors(), snapshot):
                t.copy_(saved)

    def _capture_cuda(self, step, pool) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture: lazy inits, autotuning
            for _ in range(2):
                step(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = step(*self.inputs)

    def replay(self, ids: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)  # copy into the captured buffer; never rebind it
        if isinstance(self.graph, torch.cuda.CUDAGraph):
            self.graph.replay()
            return self.logits.clone()
        return self.graph(*self.inputs)


class GraphDecoder(Decoder):
    mode = "graph"

    def __init__(self, model, cache: DS4Cache, scratch_padding: bool = False):
        super().__init__(model, cache)
        self.scratch_padding = scratch_padding
        self.graphs: dict[int, _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle() if cache.device.type == "cuda" else None
        self.backend = "cuda" if cache.device.type == "cuda" else "emulator"
        self.eager_fallbacks = 0

    def warmup_ids(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.long, device=self.cache.device)

    def _replayable(self, captured: _Captured) -> bool:
        # A graph only ever touches the buffers it captured: if the cache was reallocated, replay
        # would read stale memory, so such a step runs eagerly (and the graph is recaptured).
        return captured.buffers == [t.data_ptr() for t in self.cache.narrow(captured.n).tensors()]

    def bucket(self, n: int) -> int:
        """The batch size of the graph that serves a step of `n` sequences."""
        if not self.scratch_padding:
            return n
        return min(1 << (n - 1).bit_length(), self.cache.batch_size)

    @torch.no_grad()  # as eager's inference mode: a capture under autograd replayed other values
    def _step(self, input_ids, n):
        b = self.bucket(n)
        if b > n:
            # Padding rows are scratch: kept at position 0, their writes never reach a window that
            # closes and they never run out of room.
            self.cache.positions[n:b].zero_()
            input_ids = torch.cat([input_ids, input_ids.new_zeros(b - n)])
        return self._replay(input_ids, b)[:n]

    def _replay(self, input_ids, n):
        captured = self.graphs.get(n)
        if captured is not None and not self._replayable(captured):
            del self.graphs[n]
            self.eager_fallbacks += 1
            return self._eager_step(input_ids, n)
        if captured is None:
            captured = self.graphs[n] = _Captured(self, n)
        return captured.replay(input_ids)

    def reset(self) -> None:
        self.graphs.clear()
        if self.cache.device.type == "cuda":
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------- speculative steps
class SpeculativeForwards:
    """The forwards of a speculative decoding step (`ds4_torch.speculative`), eagerly: every one
    of a fixed shape, so the graph and compiled variants serve every step.

    - `mtp(streams [B,1,n,H], ids [B,1], undo)`: one MTP pass (a draft) -> (logits [B,1,V],
      output streams [B,1,n,H]);
    - `verify(ids [B,T], undo)`: the main model over the pending token and the drafts ->
      (logits [B,T,V], hidden streams [B,T,n,H]);
    - `catch_up(streams [B,T,n,H], ids [B,T], select [B], undo)`: the MTP layer over the verified
      positions -> (logits [B,1,V], output streams [B,1,n,H]) at position select[b];
    - `rollback(undo, keep [B])`: `undo.apply(keep)`."""

    mode = "eager"

    def __init__(self, model, cache: DS4Cache):
        self.model, self.cache = model, cache

    def mtp(self, streams, ids, undo):
        return self.model.mtp_forward(streams, ids, self.cache, logits_to_keep=1, undo=undo)

    def verify(self, ids, undo):
        return self.model._forward(ids, self.cache, logits_to_keep=ids.shape[1], return_streams=True, undo=undo)

    def catch_up(self, streams, ids, select, undo):
        return self.model.mtp_forward(streams, ids, self.cache, undo=undo, select=select)

    def rollback(self, undo, keep):
        undo.apply(keep)


class _ForwardsByKind(SpeculativeForwards):
    """Forwards whose three kinds go through one `_run(kind, args, undo)`: captured graphs or
    compiled functions, which return the `Rollback` tensors that `rollback_template` completes."""

    def _run(self, kind, args, undo):
        raise NotImplementedError

    def rollback_template(self, kind, args) -> Rollback:
        """The record of a `kind` forward of these `args`: the main cache's for `verify`, the MTP
        layer's otherwise, over the forward's T positions."""
        if kind == "verify":
            return Rollback.template(self.cache, args[0].shape[1])
        return Rollback.template(self.cache.mtp, args[1].shape[1])

    def mtp(self, streams, ids, undo):
        return self._run("mtp", (streams, ids), undo)

    def verify(self, ids, undo):
        return self._run("verify", (ids,), undo)

    def catch_up(self, streams, ids, select, undo):
        return self._run("catch_up", (streams, ids, select), undo)


def emulate_capture(fn, inputs):
    """The capture emulator: `fn(*inputs)` traced once by `make_fx` with real tensors, so every
    value read on the host and every branch taken is frozen into the graph, as a CUDA-graph
    capture freezes them. The trace runs under one fake mode for the whole capture: otherwise
    make_fx builds a new one (and walks the Python stack) for every node's metadata, which made a
    capture twice as slow. Nor does it record node metadata (a fake tensor per node, the torch
    function called), which only later compilers read: that halves a capture again."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    _skip_node_values_when_emulating()
    _emulating.active = True
    try:
        with tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))):
            return make_fx(fn, tracing_mode="real", _disable_torch_fn_metadata_mode=True)(*inputs)
    finally:
        _emulating.active = False


_emulating = threading.local()  # per thread: another thread's make_fx (torch.compile's) keeps its metadata


def _skip_node_values_when_emulating() -> None:
    """make_fx gives each node a fake tensor of its value (`meta["val"]`, through `set_meta` and
    `extract_val`) for compilers to read; a replayed graph never reads it. In the emulator's
    thread those two record nothing; everywhere else they are torch's own."""
    from torch.fx.experimental import proxy_tensor

    if getattr(proxy_tensor.set_meta, "skipped_when_emulating", False):
        return
    set_meta, extract_val = proxy_tensor.set_meta, proxy_tensor.extract_val

    def set_meta_unless_emulating(proxy, val):
        return proxy if getattr(_emulating, "active", False) else set_meta(proxy, val)

    def extract_val_unless_emulating(val, include_real=False):
        return None if getattr(_emulating, "active", False) else extract_val(val, include_real)

    set_meta_unless_emulating.skipped_when_emulating = True
    proxy_tensor.set_meta, proxy_tensor.extract_val = set_meta_unless_emulating, extract_val_unless_emulating


class _CapturedCall:
    """One captured call of a speculative step's function (shapes fixed): static input buffers,
    the cache's tensors as graph inputs (`extra`: more tensors read in place, a forward graph's
    static outputs on CUDA), the outputs. Captured with the decode graphs' backends (`_Captured`):
    a CUDA graph, or the make_fx emulator elsewhere, which freezes any value read on the host at
    capture exactly as a CUDA graph would (and refuses an .item() or int() of a traced tensor)."""

    def __init__(self, forwards: "GraphForwards", fn, args: tuple[torch.Tensor, ...], extra=()):
        cache = forwards.cache
        self.buffers = [t.data_ptr() for t in cache.tensors()]
        self.static = [a.clone() for a in args]
        self.n_static, self.extra = len(self.static), list(extra)
        self.inputs = [*self.static, *self.extra, *cache.tensors()]
        snapshot = [t.clone() for t in cache.tensors()]
        try:
            if cache.device.type == "cuda":
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up outside capture
                    for _ in range(2):
                        fn(*self.inputs)
                        for t, saved in zip(cache.tensors(), snapshot):
                            t.copy_(saved)
                torch.cuda.current_stream().wait_stream(side)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, pool=forwards.pool):
                    self.outputs = fn(*self.inputs)
            else:
                self.graph = emulate_capture(fn, self.inputs)
        finally:  # capture ran (emulator) or warmed up (CUDA) the call on the live state: put it back
            for t, saved in zip(cache.tensors(), snapshot):
                t.copy_(saved)

    def replay(self, args, extra=()):
        for buffer, a in zip(self.static, args):
            buffer.copy_(a)  # into the captured buffers; never rebind them
        if isinstance(self.graph, torch.cuda.CUDAGraph):
            self.graph.replay()
            return self.outputs  # static: valid until this graph replays again
        return self.graph(*self.static, *extra, *self.inputs[self.n_static + len(self.extra):])


class GraphForwards(_ForwardsByKind):
    """The forwards of a speculative step, and their rollbacks, captured once per kind and shape
    (batch, 1 + N) and replayed: `verify`, `catch_up`, and `mtp` once per draft index (each keeps
    its own static outputs until its rollback). A forward without a `Rollback` (the first draft
    after a prefill) runs eagerly."""

    mode = "graph"

    def __init__(self, model, cache: DS4Cache):
        super().__init__(model, cache)
        self.eager = SpeculativeForwards(model, cache)
        self.graphs: dict[tuple, _CapturedCall] = {}
        self.rollbacks: dict[tuple, _CapturedCall] = {}
        self.pool = torch.cuda.graph_pool_handle() if cache.device.type == "cuda" else None
        self.backend = "cuda" if cache.device.type == "cuda" else "emulator"
        self.drafts = 0  # one-token MTP passes since the last verify: the draft index

    def _current(self, table, key):
        captured = table.get(key)
        if captured is not None and captured.buffers != [t.data_ptr() for t in self.cache.tensors()]:
            table.clear()  # the cache was reallocated: recapture
            self.rollbacks.clear()
            captured = None
        return captured

    def _run(self, kind, args, undo):
        if undo is None:
            return getattr(self.eager, kind)(*args, None)
        if kind == "mtp":
            self.drafts += 1
        elif kind == "verify":
            self.drafts = 0
        key = (kind, self.drafts if kind == "mtp" else 0, *[tuple(a.shape) for a in args])
        captured = self._current(self.graphs, key)
        template = self.rollback_template(kind, args)
        if captured is None:
            eager, n = self.eager, len(args)

            def step(*inputs):  # the static buffers, then the cache's tensors (graph inputs)
                recorded = Rollback()
                logits, streams = getattr(eager, kind)(*inputs[:n], recorded)
                return (logits, streams, *recorded.tensors())

            captured = self.graphs[key] = _CapturedCall(self, step, args)
        outputs = captured.replay(args)
        undo.__dict__.update(template.with_tensors(outputs[2:]).__dict__)
        undo.graph_key = key
        logits = outputs[0].clone() if self.backend == "cuda" else outputs[0]  # the caller keeps its rows
        return logits, outputs[1]

    def rollback(self, undo, keep):
        key = getattr(undo, "graph_key", None)
        if key is None:
            return undo.apply(keep)
        tensors = undo.tensors()
        captured = self._current(self.rollbacks, key)
        if captured is None:
            def apply(keep, *inputs):  # the record's tensors, then the cache's
                undo.with_tensors(inputs[:len(tensors)]).apply(keep)
                return ()

            captured = self.rollbacks[key] = _CapturedCall(self, apply, (keep,), extra=tensors)
        captured.replay((keep,), tensors)


def _compiled_mtp(model, cache, streams, ids):
    undo = Rollback()
    return (*model.mtp_forward(streams, ids, cache, logits_to_keep=1, undo=undo), *undo.tensors())


def _compiled_verify(model, cache, ids):
    undo = Rollback()
    return (*model._forward(ids, cache, logits_to_keep=ids.shape[1], return_streams=True, undo=undo),
            *undo.tensors())


def _compiled_catch_up(model, cache, streams, ids, select):
    undo = Rollback()
    return (*model.mtp_forward(streams, ids, cache, undo=undo, select=select), *undo.tensors())


_COMPILED: dict = {}  # (kind, backend) -> the compiled function, shared by every CompiledForwards


class CompiledForwards(_ForwardsByKind):
    """The forwards of a speculative step through `torch.compile(fullgraph=True)` (inductor): one
    module-level function per kind (model and cache are arguments, so a new cache or speculator
    reuses what was compiled), compiled at its first call for each shape; they return the
    `Rollback` tensors, completed from `Rollback.template`."""

    mode = "compile"

    def __init__(self, model, cache: DS4Cache, backend: str = "inductor"):
        super().__init__(model, cache)
        self.compiled = {}
        for kind, fn in (("mtp", _compiled_mtp), ("verify", _compiled_verify), ("catch_up", _compiled_catch_up)):
            if (kind, backend) not in _COMPILED:
                _COMPILED[kind, backend] = torch.compile(fn, fullgraph=True, backend=backend)
            self.compiled[kind] = _COMPILED[kind, backend]

    def _run(self, kind, args, undo):
        if undo is None:  # eagerly, as the base class runs it
            return getattr(SpeculativeForwards, kind)(self, *args, None)
        out = self.compiled[kind](self.model, self.cache, *args)
        undo.__dict__.update(self.rollback_template(kind, args).with_tensors(out[2:]).__dict__)
        return out[0], out[1]


def make_forwards(model, cache: DS4Cache, mode: str = "eager") -> SpeculativeForwards:
    """The forwards of a speculative step over `cache` in decode mode `mode` (env
    DS4_TORCH_DECODE_MODE overrides; "auto" as for `make_decoder`): eager, captured graphs
    (`GraphForwards`: CUDA graphs, or the emulator elsewhere) or compiled (`CompiledForwards`)."""
    resolved = resolve_mode(mode, cache.device)
    if resolved == "graph":
        return GraphForwards(model, cache)
    if resolved == "compile":
        return CompiledForwards(model, cache)
    return SpeculativeForwards(model, cache)
