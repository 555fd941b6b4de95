"""Peak host memory of `DS4ForCausalLM.from_pretrained` with quantized="keep" vs "dequantize".

    python examples/measure_load_memory.py                  # writes a ~1.1 GB FP8/FP4 checkpoint under /tmp
    python examples/measure_load_memory.py --checkpoint DIR # measures an existing checkpoint

(From a checkout whose ds4_torch is not the installed one: PYTHONPATH=. python examples/...;
the measured ds4_torch is printed.)

The synthetic checkpoint is shaped like DeepSeek-V4's, in its upstream layout (the writer of
`ds4-torch bench quant`): routed experts FP4 (e2m1 packed two per byte, e8m0 scale per 32
inputs, one tensor per expert and projection), every linear except the head FP8 with e8m0
128x128 block scales, the rest bf16; one shard per layer. Weights are random: only sizes matter. It is deleted afterwards unless
--keep-files.

Each load runs in a fresh subprocess that first loads the 10 MB embedded model (so every lazily
imported module is in the baseline), then reports: VmHWM (peak resident set, = ru_maxrss), the
resident set before the load, the peak growth of its anonymous and file-backed parts (sampled
every ~2 ms; file-backed pages are the safetensors shards mapped while reading), and the bytes
of the loaded model's tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

GIB = 2**30


def status_bytes(field: str) -> int:
    """A `/proc/self/status` memory field (kB there) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def synthetic_config(layers: int, hidden: int, experts: int, intermediate: int):
    """A DS4 config with the default model's structure and the given sizes."""
    from ds4_torch import DS4Config
    from ds4_torch.default_model import DEFAULT_MODEL_DIR

    raw = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    raw.update(
        vocab_size=4096, hidden_size=hidden, moe_intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=8, head_dim=128, q_lora_rank=256, o_groups=4, o_lora_rank=128,
        index_n_heads=8, index_head_dim=64, n_routed_experts=experts,
        layer_types=[kinds[i % 3] for i in range(layers)],
        mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1),
    )
    return DS4Config.from_dict(raw)


def write_synthetic_checkpoint(directory, config, seed: int = 0) -> Path:
    """config.json + one upstream-layout shard per layer: `ds4-torch bench quant`'s writer."""
    from ds4_torch.bench.quant import write_checkpoint

    return write_checkpoint(directory, config, seed)


def measure_load(path, quantized: str, dtype: torch.dtype) -> dict:
    """Load once in this process and report memory; run it in a fresh process per measurement."""
    from ds4_torch import DS4ForCausalLM
    from ds4_torch.default_model import build_default_model

    build_default_model()  # warm-up (10 MB, freed): the baseline then includes every lazily imported module
    baseline = {field: status_bytes(field) for field in ("VmRSS", "RssAnon", "RssFile")}
    peaks = {"RssAnon": 0, "RssFile": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            for field in peaks:
                peaks[field] = max(peaks[field], status_bytes(field))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    model = DS4ForCausalLM.from_pretrained(path, dtype=dtype, quantized=quantized, progress=False)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    tensors = {t.data_ptr(): t for t in [*model.state_dict().values(), *model.buffers()]}
    return {
        "quantized": quantized,
        "peak_rss": status_bytes("VmHWM"),
        "rss_before_load": baseline["VmRSS"],
        "peak_anon_growth": peaks["RssAnon"] - baseline["RssAnon"],
        "peak_file_growth": peaks["RssFile"] - baseline["RssFile"],
        "model_tensor_bytes": sum(t.nbytes for t in tensors.values()),
        "load_seconds": seconds,
    }


def measure_in_subprocess(path, quantized: str, dtype: str) -> dict:
    import ds4_torch

    env = dict(os.environ)
    # the child imports the same ds4_torch as this process (a checkout, not an installed copy)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(ds4_torch.__file__).resolve().parents[1]),
                                         *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, __file__, "--child", str(path), "--quantized", quantized, "--dtype", dtype],
                         env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"measuring a {quantized!r} load of {path} failed (exit {out.returncode}):\n"
                           f"{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gib(n: int) -> str:
    return f"{n / GIB:.3f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="measure this checkpoint directory instead of writing one")
    p.add_argument("--dir", help="where to write the synthetic checkpoint (default: a new directory in /tmp)")
    p.add_argument("--keep-files", action="store_true", help="do not delete the synthetic checkpoint")
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--quantized", default="keep", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    if args.child:
        print(json.dumps(measure_load(args.child, args.quantized, dtype)))
        return

    written = None
    if args.checkpoint:
        path = Path(args.checkpoint)
    else:
        written = path = Path(args.dir or tempfile.mkdtemp(prefix="ds4-load-memory-", dir="/tmp"))
        config = synthetic_config(args.layers, args.hidden, args.experts, args.intermediate)
        print(f"writing a synthetic FP8/FP4 checkpoint to {path} ...", file=sys.stderr)
        write_synthetic_checkpoint(path, config)
    try:
        file_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        rows = [measure_in_subprocess(path, q, args.dtype) for q in ("keep", "dequantize")]
    finally:
        if written is not None and not args.keep_files:
            shutil.rmtree(written)
    import ds4_torch

    print(f"ds4_torch: {Path(ds4_torch.__file__).parent}")
    print(f"checkpoint: {path} ({_gib(file_bytes)} GiB of safetensors), dtype {args.dtype}")
    print("| quantized | peak RSS (VmHWM) | RSS before load | peak - before | anon growth (peak) "
          "| file-backed growth (peak) | model tensor bytes | load s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['quantized']} | {_gib(r['peak_rss'])} | {_gib(r['rss_before_load'])} "
              f"| {_gib(r['peak_rss'] - r['rss_before_load'])} | {_gib(r['peak_anon_growth'])} "
              f"| {_gib(r['peak_file_growth'])} | {_gib(r['model_tensor_bytes'])} | {r['load_seconds']:.1f} |")
    print("(GiB; growth columns: sampled every ~2 ms; file-backed = safetensors shards mapped while read)")


if __name__ == "__main__":
    main()
