"""One rank of a tensor-parallel run, started by the tests (tests/test_tensor_parallel.py) with
the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set.

    python tests/tp_worker.py logits CHECKPOINT IDS.pt PREFILL OUT_DIR [eager|graph] [dequantize|keep]

writes OUT_DIR/rank{R}.pt: the logits of a prefill of the first PREFILL ids, then one decode step
per remaining id (eager forwards, or the graph decoder), with FP8/FP4 weights dequantized at load
(default) or kept quantized."""
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


def main(argv):
    import torch.distributed as dist

    from ds4_torch import DS4ForCausalLM

    _, checkpoint, ids_path, prefill, out_dir, *rest = argv
    mode = rest[0] if rest else "eager"
    quantized = rest[1] if len(rest) > 1 else "dequantize"
    model = DS4ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_backend="torch", quantized=quantized,
                                           tp=int(os.environ["WORLD_SIZE"]))
    logits = prefill_decode_logits(model, torch.load(ids_path), int(prefill), mode)
    torch.save(logits, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
