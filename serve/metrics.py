"""Prometheus metrics of one server app, in a registry of its own (several apps can share a
process, as they do in the tests, without clashing in prometheus_client's global registry)."""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

disable_created_metrics()  # no `*_created` series: they only clutter the exposition

BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0)
STEP_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ds4_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "code"], registry=r)
        self.prompt_tokens = Counter("ds4_prompt_tokens", "Prompt tokens of generation requests", registry=r)
        self.cached_prompt_tokens = Counter(
            "ds4_cached_prompt_tokens", "Prompt tokens reused from the live KV cache (not prefilled again)",
            registry=r)
        self.reuse_reasons = Counter(
            "ds4_prompt_reuse", "Requests by what limited their prompt's reuse (serve.engine.reuse): new, full, "
            "diverged, no_checkpoint, evicted, pool, evicted_to_disk, prompt_logprobs, other_tenant", ["reason"],
            registry=r)
        self.reused_tokens = Counter("ds4_reused_prompt_tokens", "Prompt tokens reused, by where they came from: "
                                     "session, shared, checkpoint, disk", ["source"], registry=r)
        self.generated_tokens = Counter("ds4_generated_tokens", "Tokens generated", registry=r)
        self.prefill_chunks = Counter("ds4_prefill_chunks", "Prefill chunks run through the model", registry=r)
        self.prefill_aborted = Counter(
            "ds4_prefill_aborted",
            "Requests abandoned by their client before the engine finished them (while queued, in prefill or in "
            "decode); work stops at the next chunk or token boundary", registry=r)
        self.aborted = Counter("ds4_requests_aborted", "Abandoned requests by the stage they were in",
                               ["stage"], registry=r)
        self.api_behind = Counter("ds4_api_process_behind", "Times an API process left more than "
                                  "--api-backlog-mb of the engine core's output unread: that output dropped, its "
                                  "requests cancelled", registry=r)
        self.device_errors = Counter("ds4_device_errors",
                                     "Device errors / out-of-memory caught in prefill or decode", registry=r)
        self.engine_resets = Counter("ds4_engine_resets", "Engine resets (cache cleared, graphs dropped)",
                                     registry=r)
        self.markup_dropped = Counter("ds4_markup_dropped", "Markup the model emitted out of place, kept out of "
                                      "the text: token (a special token or tag), block (a call block that does not "
                                      "parse), call (a call to a tool not offered, or failing its schema)",
                                      ["kind"], registry=r)
        self.queue_depth = Gauge("ds4_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge("ds4_requests_running", "Requests the engine is working on (decoding or prefilling)",
                             registry=r)
        self.resident_sessions = Gauge("ds4_resident_sessions", "Conversations held in the resident KV cache",
                                       registry=r)
        self.cache_tokens = Gauge("ds4_live_cache_tokens", "Tokens held by the resident sessions", registry=r)
        self.session_evictions = Counter("ds4_session_evictions",
                                         "Idle resident sessions evicted to make room for another conversation",
                                         registry=r)
        # The paged KV pool (ds4_torch.paged): compressed and indexer rows in blocks of block_tokens tokens.
        self.kv_blocks_total = Gauge("ds4_kv_blocks_total", "Blocks in the KV pool", registry=r)
        self.kv_blocks_used = Gauge("ds4_kv_blocks_used", "KV blocks held by a sequence (running or resident)",
                                    registry=r)
        self.kv_blocks_shared = Gauge("ds4_kv_blocks_shared", "KV blocks held by more than one sequence (a shared "
                                      "prefix stored once)", registry=r)
        self.kv_blocks_cached = Gauge("ds4_kv_blocks_cached", "KV blocks no sequence holds, kept for reuse until "
                                      "the pool needs them", registry=r)
        self.kv_block_bytes = Gauge("ds4_kv_block_bytes", "Bytes of one KV block across all layers", registry=r)
        self.kv_block_tokens = Gauge("ds4_kv_block_tokens", "Tokens of context one KV block covers", registry=r)
        self.preemptions = Counter("ds4_preemptions", "Requests set aside because the KV pool could not hold their "
                                   "next tokens (resumed later from what they had sent)", registry=r)
        self.branches = Counter("ds4_branches", "Requests that branched from a checkpoint of another session "
                                "(its compressed rows copied, the source left as it was)", registry=r)
        self.rewinds = Counter("ds4_rewinds", "Idle sessions rewound in place to a checkpoint (their later tokens "
                               "dropped) for a request diverging from them", registry=r)
        self.checkpoint_bytes = Gauge("ds4_checkpoint_bytes", "Bytes of the checkpoints held (one rank's; logits "
                                      "counted at 4 bytes)", registry=r)
        self.batch_size = Histogram("ds4_batch_size", "Sequences in each batched decode step", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.inter_token = Histogram("ds4_inter_token_latency_seconds",
                                     "Time between two tokens of one request", buckets=ITL_BUCKETS, registry=r)
        self.step_time = Histogram("ds4_step_seconds", "Each decode iteration's wall time by part: model (the "
                                   "decode step, and a prefill chunk run beside it), sampling (the batched sampler "
                                   "call), host (the rest: scheduling, bookkeeping, handing tokens over)",
                                   ["part"], buckets=STEP_BUCKETS, registry=r)
        # Speculative decoding (serve --speculative-tokens N): acceptance length = emitted / verify steps.
        self.spec_steps = Counter("ds4_spec_verify_steps", "Speculative verify steps, counted per sequence",
                                  registry=r)
        self.spec_drafted = Counter("ds4_spec_draft_tokens", "Draft tokens proposed by the MTP layer", registry=r)
        self.spec_accepted = Counter("ds4_spec_accepted_tokens", "Draft tokens accepted (equal to the token the "
                                     "model samples at their position)", registry=r)
        self.spec_emitted = Counter("ds4_spec_emitted_tokens", "Tokens emitted by speculative verify steps "
                                    "(accepted drafts plus one sampled token each)", registry=r)
        self.spec_acceptance = Gauge("ds4_spec_acceptance_length", "Mean tokens emitted per speculative verify "
                                     "step since start, the bonus token included (1 = no draft accepted)", registry=r)
        self.healthy = Gauge("ds4_engine_healthy", "1 when the engine is usable, 0 while degraded", registry=r)
        self.healthy.set(1)
        self.ttft = Histogram("ds4_time_to_first_token_seconds",
                              "Time from request arrival to the first generated token", buckets=TTFT_BUCKETS,
                              registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, **labels) -> float:
        """A sample's current value (0 when absent): for tests and the benchmark."""
        v = self.registry.get_sample_value(name, labels or None)
        return 0.0 if v is None else v
