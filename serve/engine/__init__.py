"""The engine: `loop.Engine` is the worker thread, a loop over its parts (reap, decode step, prefill
step, hand outputs on). The parts share only `sequence` (one request's state and the records
handed to `output`) and never import each other:

- `scheduler`: who runs next (the queue, disk reads aside);
- `sessions`: resident sessions, checkpoints, branch and rewind, eviction, disk snapshots, over
  `prefix_index` (which registered sequence and checkpoint a prompt can reuse) and `reuse` (what
  each request reused and why not more);
- `runner`: the only part touching tensors (prefill, decode, speculative steps, the batched
  sampler), through `replica` (what --tp broadcasts);
- `output`: token ids to text, stop strings (`stops`), events, on its own thread;
- `inflight`, `admission`, `decoding`, `recovery`, `speculation`: the requests in flight and
  preemption, admission and prefill, the decode steps, failed steps, which steps speculate.

Imports only `serve.kvstore`, `serve.errors`, `serve.metrics` and the library.
"""
