"""How many DeepSeek-V4-Flash sessions fit two H200s: static vs paged compressed KV, bf16 vs fp8.

Shapes only (`ds4_torch.config.v4_flash_config`, no weights). With tensor parallelism the one
KV head's compressed and indexer rows are replicated on every rank, so each rank's memory less
its share of the weights is the budget for every session; two H200s hold as many sessions as
one rank's budget allows. Defaults: 140 GiB per H200 (nvidia-smi's 143,771 MiB) and 73 GiB of
keep-quantized weights per rank at --tp 2. Activations, CUDA graphs and the framework are not
counted. The numbers come from `ds4_torch.footprint.session_table`.

    PYTHONPATH=. python examples/kv_sessions_table.py [--memory-gib 140] [--weights-gib 73]
"""
from __future__ import annotations

import argparse

import torch

from ds4_torch.config import v4_flash_config
from ds4_torch.footprint import format_session_table, kv_bytes_per_token, sequence_fixed_bytes, session_table
from ds4_torch.kv_format import KV_ROW_FORMATS


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--memory-gib", type=float, default=140.0, help="memory of one device (default 140)")
    p.add_argument("--weights-gib", type=float, default=73.0, help="weights held per rank (default 73)")
    p.add_argument("--shared-prefix", type=int, default=20 * 1024, help="tokens every session shares (20K)")
    p.add_argument("--block-tokens", type=int, default=256)
    args = p.parse_args(argv)
    cfg, dtype = v4_flash_config(), torch.bfloat16
    full = kv_bytes_per_token(cfg, "full", dtype)
    print(f"V4-Flash, compressed and indexer rows per token of context (window ring and open windows: "
          f"{sequence_fixed_bytes(cfg, dtype) / 2**20:.1f} MiB per running sequence in bf16, not included):")
    for name in KV_ROW_FORMATS:
        b = kv_bytes_per_token(cfg, name, dtype)
        print(f"  {name:<9} {b:8.2f} B/token ({b / full:.3f}x bf16)")
    budget = (args.memory_gib - args.weights_gib) * 2**30
    print(f"\nsessions per {args.memory_gib:g} GiB device with {args.weights_gib:g} GiB of weights "
          f"({budget / 2**30:g} GiB for KV); shared prefix {args.shared_prefix:,} tokens:\n")
    print(format_session_table(session_table(cfg, dtype, budget, block_tokens=args.block_tokens,
                                             shared_prefix=args.shared_prefix)))


if __name__ == "__main__":
    main()
