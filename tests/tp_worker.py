"""One rank of a tensor-parallel run, started by the tests (tests/library/test_tensor_parallel.py) with
the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set.

    python tests/tp_worker.py logits JOBS.json PREFILL OUT_DIR

(`speculate`: speculative decoding under tensor parallelism, see `speculate`.)

JOBS.json: {name: {"checkpoint", "ids" (a saved tensor), "mode" (eager|graph), "quantized"
(dequantize|keep)}}, run in turn in one launch; writes OUT_DIR/{name}.rank{R}.pt per job: the
logits of a prefill of the first PREFILL ids, then one decode step per remaining id (eager
forwards, or the graph decoder), with FP8/FP4 weights dequantized at load or kept quantized."""
from __future__ import annotations

import os
import sys

import torch

torch.set_num_threads(1)


@torch.no_grad()
def prefill_decode_logits(model, ids: torch.Tensor, prefill: int, mode: str = "eager") -> torch.Tensor:
    """Logits [1, len(ids), vocab]: one prefill forward over ids[:prefill], then one decode step
    per remaining id, teacher-forced (so every rank and the reference see the same inputs)."""
    cache = model.new_cache(1, ids.shape[1] + 1)
    outs = [model(ids[:, :prefill], cache)]
    if mode == "graph":
        from ds4_torch.decode import make_decoder

        decoder = make_decoder(model, cache, mode="graph")
        outs += [decoder.step(ids[0, t:t + 1])[:, None] for t in range(prefill, ids.shape[1])]
    else:
        outs += [model(ids[:, t:t + 1], cache) for t in range(prefill, ids.shape[1])]
    return torch.cat(outs, dim=1)


def speculate(argv):
    """python tests/tp_worker.py speculate CHECKPOINT OUT_DIR N NEW MODE[:SEED] [MODE[:SEED] ...]: per
    case (MODE eager or graph), greedy (or, with SEED, sampled at 0.9 with that seed) generation of
    NEW tokens after a fixed prompt with N draft tokens from the MTP layer, then a batch of two
    prompts through one Speculator; writes OUT_DIR/rank{R}.pt: per case, the tokens, the stats and
    the batch's tokens (the cases share one launch and one loaded model)."""
    import torch.distributed as dist

    from ds4_torch import DS4ForCausalLM

    checkpoint, out_dir, n, new, *cases = argv
    n, new = int(n), int(new)
    model = DS4ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_backend="torch",
                                           tp=int(os.environ["WORLD_SIZE"]))
    results = {}
    for case in cases:
        mode, _, seed = case.partition(":")
        results[case] = speculate_case(model, n, new, mode, int(seed) if seed else None)
    torch.save(results, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


def speculate_case(model, n: int, new: int, mode: str, seed: int | None) -> dict:
    from ds4_torch import generate
    from ds4_torch.sampling import BatchSampler, SamplingParams
    from ds4_torch.speculative import SpeculationStats, Speculator

    settings = dict(temperature=0.9, seed=seed) if seed is not None else {}
    stats = SpeculationStats()
    tokens = list(generate(model, SPEC_PROMPTS[0], new, speculative_tokens=n, stats=stats, decode_mode=mode,
                           prefill_chunk=4, **settings))
    cache = model.new_cache(2, 64)
    sampler = BatchSampler(2, model.config.vocab_size)
    for b in range(2):
        sampler.admit(b, SamplingParams())
    spec = Speculator(model, cache, sampler, n, batch=2, mode=mode)
    with torch.no_grad():
        batch = [[t] for t in spec.start_batch(SPEC_PROMPTS, 4)[0]]
        while min(map(len, batch)) < new:
            for b, got in enumerate(spec.step_batch([n + 1, n + 1])[0]):
                batch[b] += got
    return {"tokens": tokens, "drafted": stats.drafted, "accepted": stats.accepted, "batch": [b[:new] for b in batch]}


SPEC_PROMPTS = [[5, 9, 11, 2, 40, 33, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


def main(argv):
    import torch.distributed as dist

    from ds4_torch import DS4ForCausalLM

    if argv[0] == "speculate":
        return speculate(argv[1:])
    import json

    _, jobs_path, prefill, out_dir = argv
    with open(jobs_path) as f:
        jobs = json.load(f)
    for name, job in jobs.items():
        model = DS4ForCausalLM.from_pretrained(job["checkpoint"], dtype=torch.float32, attn_backend="torch",
                                               quantized=job["quantized"], tp=int(os.environ["WORLD_SIZE"]))
        logits = prefill_decode_logits(model, torch.load(job["ids"]), int(prefill), job["mode"])
        torch.save(logits, os.path.join(out_dir, f"{name}.rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
