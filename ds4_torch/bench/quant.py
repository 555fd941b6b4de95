"""`ds4-torch bench quant`: one quantized checkpoint loaded kept quantized (`--quantized keep`)
and dequantized to bf16, in the same run: decode ms/token, prefill tokens/s, tensor bytes per
parameter and peak RSS, and whether both decode the same greedy tokens; with a llama.cpp build
(`--llama-cpp`, or `llama-bench` on PATH), llama.cpp on the same checkpoint converted by its own
converter (`llama_cpp.py`), at the same thread counts.

The roofline: on a CPU the run also measures the machine's read bandwidth (a native sum over 1
GiB, torch's sum without native code) at one thread, at all of the machine's, and at each count
timed, in the speed process between the decode runs (so under the same load), and prints each
implementation's weight GB/s (the weight bytes a decode step reads at least, as stored, per decode
time) as a fraction of the one-thread and the all-thread bandwidth.

Without `--model` it first writes a checkpoint with V4-Flash's real tensor sizes in DeepSeek's
upstream layout (`write_checkpoint`, also `python -m ds4_torch.bench.quant --write DIR`): names as
DeepSeek ships them (`layers.0.attn.wq_a.weight` + `.scale`, `layers.0.ffn.experts.3.w1.weight`),
every linear but the head FP8 e4m3 with e8m0 128x128 block scales, routed experts FP4 (e2m1 two
per byte, an e8m0 scale per 32 inputs), the rest bf16 (float32 where the model keeps float32:
norms, mHC, sinks). Its layers (default one CSA layer) and
routed experts (default 16 of V4-Flash's 256) are the only sizes cut down. It goes to a temporary
directory, deleted afterwards. Weights are random: only sizes and speed matter here.

Memory: each mode loads in a child process of its own, so that its peak RSS (ru_maxrss) is its
own. Speed: one more child loads both and times them in turns, at every thread count (`--threads
1 2`) and with llama-bench between them, best of `--repeats` each, so that all see the same load
on a shared machine.
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

MODES = ("keep", "dequantize")
FP8_BLOCK = 128
FP4_GROUP = 32


def add_arguments(parser) -> None:
    from ..runtime import positive_int

    parser.add_argument("--model", metavar="DIR", help="a quantized checkpoint; default: write a real-size one")
    parser.add_argument("--layers", type=positive_int, default=1, help="layers of the written checkpoint (CSA, HCA, ...)")
    parser.add_argument("--experts", type=positive_int, default=16, help="routed experts of the written checkpoint")
    parser.add_argument("--prompt-len", type=positive_int, default=64, help="prefill tokens (default 64)")
    parser.add_argument("--new-tokens", type=positive_int, default=9, help="generated tokens (default 9)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="runs per mode; the best prefill and decode are shown (default 3)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default) or cuda: on a GPU the peak column is the GPU's allocated memory and "
                             "the weight GB/s is set against the device's peak bandwidth")
    parser.add_argument("--threads", type=positive_int, nargs="+", default=None, metavar="N",
                        help="thread counts to time (torch.set_num_threads; llama.cpp's -t), e.g. 1 2; "
                             "default: torch's own")
    parser.add_argument("--llama-cpp", metavar="PATH", default=None,
                        help="a llama.cpp build (its llama-bench, a directory holding it, or a source tree built "
                             "in build/) to time as the peer; default: llama-bench on PATH, else ours alone")
    parser.add_argument("--csv", metavar="FILE", help="also write the table as CSV")


# --------------------------------------------------------------------------- the checkpoint
def upstream_name(hf_key: str) -> str:
    """The DeepSeek upstream name of a model key: the loader's renames (`loading.RENAMES`) run
    backwards, checked by running them forwards."""
    from ..loading import RENAMES, rename_checkpoint_key

    key = hf_key.removeprefix("model.")
    for pattern, replacement in reversed(RENAMES):
        source = pattern.pattern.replace("\\", "")
        head, tail = source.startswith("^"), source.endswith("$")
        source = source.strip("^$")
        if head and tail:
            key = source if key == replacement else key
        elif tail:
            key = key[:-len(replacement)] + source if key.endswith(replacement) else key
        elif head:
            key = source + key[len(replacement):] if key.startswith(replacement) else key
        else:
            key = key.replace(replacement, source, 1)
    # the attention's kv_norm ships as is (the loader's `.norm.` rename is the compressors'), as
    # llama.cpp's DeepSeek-V4 converter, written against the release, expects
    key = key.replace(".attn.norm.", ".attn.kv_norm.")
    if rename_checkpoint_key(key) != hf_key.removeprefix("model."):
        raise ValueError(f"no upstream name found for {hf_key}")
    return key


def real_size_config(layers: int, experts: int):
    """V4-Flash's sizes (`DS4Config` defaults) with `layers` CSA/HCA layers and `experts` experts."""
    from ..config import CSA, HCA, DS4Config

    return DS4Config(num_hidden_layers=layers, layer_types=tuple((CSA, HCA)[i % 2] for i in range(layers)),
                     mlp_layer_types=("moe",) * layers, n_routed_experts=experts)


def write_checkpoint(directory, config, seed: int = 0) -> Path:
    """config.json + one upstream-layout safetensors shard per layer (and one for the rest)."""
    from safetensors.torch import save_file
    from torch import nn

    from ..model import FP32_PARAM_MARKERS, DS4ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config.save(directory)
    with torch.device("meta"):
        model = DS4ForCausalLM(config)
    g = torch.Generator().manual_seed(seed)

    def e8m0(shape):  # scales 2^-11 .. 2^-6: weights of magnitude ~0.01..1
        return torch.randint(116, 122, shape, dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)

    shards: dict[str, dict] = {}
    for key, t in model.state_dict().items():
        layer = re.match(r"model\.layers\.(\d+)\.", key)
        tensors = shards.setdefault(f"layer-{int(layer[1]):03d}" if layer else "rest", {})
        owner = model.get_submodule(key.rpartition(".")[0])
        if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            prefix = upstream_name(key.rpartition(".")[0] + ".0.w1.weight").rpartition(".0.w1.weight")[0]
            parts = ("w1", "w3") if key.endswith("gate_up_proj") else ("w2",)
            rows, cols = t.shape[1] // len(parts), t.shape[2]
            for e in range(t.shape[0]):
                for part in parts:
                    name = f"{prefix}.{e}.{part}"
                    tensors[name + ".weight"] = torch.randint(-128, 128, (rows, cols // 2), dtype=torch.int8, generator=g)
                    tensors[name + ".scale"] = e8m0((rows, cols // FP4_GROUP))
        elif isinstance(owner, nn.Linear) and key.endswith(".weight") and key != "lm_head.weight":
            rows, cols = t.shape
            name = upstream_name(key).removesuffix(".weight")
            tensors[name + ".weight"] = (torch.randn(rows, cols, generator=g) * 64).clamp_(-448, 448).to(torch.float8_e4m3fn)
            tensors[name + ".scale"] = e8m0((math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)))
        elif t.is_floating_point():  # float32 where the model keeps float32 (norms, mHC, sinks, ape)
            scale = 1.0 if key.endswith("norm.weight") else 0.02
            dtype = torch.float32 if any(mark in key for mark in FP32_PARAM_MARKERS) else torch.bfloat16
            tensors[upstream_name(key)] = (torch.randn(t.shape, generator=g) * scale).to(dtype)
        else:  # the hash-routing table
            tensors[upstream_name(key)] = torch.randint(0, config.n_routed_experts, t.shape, dtype=t.dtype, generator=g)
    weight_map = {}
    for shard, tensors in shards.items():
        file = f"model-{shard}.safetensors"
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


# --------------------------------------------------------------------------- one mode (child)
def _load(path, quantized: str, device: str = "cpu"):
    from ..model import DS4ForCausalLM

    return DS4ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantized=quantized, device=device,
                                          progress=False).eval()


def decode_weight_bytes(model) -> int:
    """Weight bytes one decode step must read at least: every tensor of the layers but the routed
    experts, top-k experts per layer (the average expert's bytes), the final norm and the head."""
    seen, total = set(), 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.data_ptr() in seen or "embed_tokens" in name:
            continue
        seen.add(t.data_ptr())
        if ".experts." in name and ".shared_experts." not in name:
            total += t.nbytes * model.config.num_experts_per_tok // t.shape[0]
        else:
            total += t.nbytes
    return total


def measure_memory(path, quantized: str, device: str = "cpu") -> dict:
    """Tensor bytes per parameter and peak memory of one mode (run it in a fresh process): RSS
    on the CPU, the GPU's peak allocated bytes on CUDA."""
    from ..model import DS4ForCausalLM
    from .model import bench_ours

    model = _load(path, quantized, device)
    with torch.no_grad():
        bench_ours(model, [2, 3, 4, 5], 2)  # the buffers a forward allocates count too
    tensors = {t.data_ptr(): t for t in [*model.state_dict().values(), *model.buffers()]}
    layers = model.model.layers
    layer_tensors = {t.data_ptr(): t for t in [*layers.state_dict().values(), *layers.buffers()]}
    with torch.device("meta"):
        dense = DS4ForCausalLM(model.config)
    tensor_bytes = sum(t.nbytes for t in tensors.values())
    return {
        "quantized": quantized,
        "tensor_gib": tensor_bytes / 2**30,
        "bytes_per_parameter": tensor_bytes / dense.num_parameters(),
        # the layers alone: what V4-Flash's 43 layers are made of (embedding and head stay bf16)
        "layer_bytes_per_parameter": sum(t.nbytes for t in layer_tensors.values())
        / sum(p.numel() for p in dense.model.layers.parameters()),
        "peak_gib": (torch.cuda.max_memory_allocated(device) if torch.device(device).type == "cuda"
                     else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30,
        "decode_weight_bytes": decode_weight_bytes(model),
    }


class ReadBandwidth:
    """The machine's read bandwidth, what a decode step's weight reads are set against: GB/s
    reading `gib` GiB at a thread count, best of the calls to `time(threads)` (`bench quant` times
    it between the decode runs, so that it sees the same load). The native word sum where native
    code runs (torch's int64 sum reads no faster with a second thread on the 2-core Xeon this was
    written on, while the native products read twice as fast), else torch's sum."""

    def __init__(self, gib: float = 1.0):
        from ..kernels import cpu_linear

        self.data = torch.ones(int(gib * 2**30) // 8, dtype=torch.int64)
        self.native = cpu_linear.read_words(self.data[:8], 1) is not None
        self.how = "a native sum" if self.native else "a torch sum"
        self.best: dict[int, float] = {}  # threads -> seconds

    def time(self, threads: int) -> None:
        import time

        from ..kernels import cpu_linear

        read = (lambda: cpu_linear.read_words(self.data, threads)) if self.native else self.data.sum
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(threads)
            if threads not in self.best:
                read()  # first touch: page faults are not reads
            start = time.perf_counter()
            read()
            self.best[threads] = min(self.best.get(threads, float("inf")), time.perf_counter() - start)
        finally:
            torch.set_num_threads(before)

    def gb_s(self) -> dict[int, float]:
        return {t: self.data.nbytes / s / 1e9 for t, s in sorted(self.best.items())}


def measure_speed(path, prompt_len: int, new_tokens: int, repeats: int, device: str = "cpu",
                  threads: list[int] | None = None, llama: dict | None = None,
                  read_threads: list[int] = ()) -> dict:
    """Both modes loaded in one process and timed in turns (so both see the same load), at each
    thread count, with llama-bench run between them when `llama` ({"bench", "source", "gguf"})
    is given, and the read bandwidth at each of `read_threads`: {"speed": {threads: {impl: best
    decode ms/token, best prefill tokens/s, (ours) the greedy tokens}}, "read_gb_s": {threads:
    GB/s}, "read_how"}. `threads` None: torch's own count."""
    from .model import bench_ours

    models = {mode: _load(path, mode, device) for mode in MODES}
    prompt = torch.randint(2, models["keep"].config.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    counts = threads or [torch.get_num_threads()]
    runs = {t: {mode: [] for mode in MODES} for t in counts}
    peer = None
    if llama:
        from .llama_cpp import LlamaCpp, time_once

        peer = LlamaCpp(Path(llama["bench"]), Path(llama["source"]))
        for t in counts:
            runs[t]["llama.cpp"] = []
    bandwidth = ReadBandwidth() if read_threads else None
    with torch.no_grad():
        for model in models.values():
            bench_ours(model, prompt[:8], 2)  # warm-up: first-call allocations, buffers
        for _ in range(repeats):
            for t in read_threads:
                bandwidth.time(t)
            for t in counts:
                torch.set_num_threads(t)
                for mode, model in models.items():
                    r = bench_ours(model, prompt, new_tokens)
                    runs[t][mode].append({"decode_ms_per_token": r["decode_s"] * 1e3 / max(len(r["tokens"]) - 1, 1),
                                          "prefill_tokens_per_s": prompt_len / r["prefill_s"], "tokens": r["tokens"]})
                if peer is not None:
                    runs[t]["llama.cpp"].append(time_once(peer, Path(llama["gguf"]), t, prompt_len, new_tokens,
                                                          llama["flags"]))
    speed = {t: {impl: {"decode_ms_per_token": min(r["decode_ms_per_token"] for r in rs),
                        "prefill_tokens_per_s": max(r["prefill_tokens_per_s"] for r in rs),
                        **({"tokens": rs[0]["tokens"]} if "tokens" in rs[0] else {})}
                 for impl, rs in by_impl.items()} for t, by_impl in runs.items()}
    return {"speed": speed, "read_gb_s": bandwidth.gb_s() if bandwidth else {},
            "read_how": bandwidth.how if bandwidth else ""}


def _child(*argv) -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the ds4_torch this process runs
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-m", "ds4_torch.bench.quant", "--child", *map(str, argv)], env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"bench quant: the {argv[0]} run failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _llama_peer(args, path: Path, work: Path) -> tuple[dict | None, str]:
    """({"bench", "source", "gguf", "decode_weight_bytes"}, "") with the checkpoint converted, or
    (None, why llama.cpp is not timed)."""
    from . import llama_cpp

    if torch.device(args.device).type != "cpu":
        return None, "llama.cpp is timed on CPU runs only"
    llama, why = llama_cpp.find(args.llama_cpp)
    if llama is None:
        return None, why
    gguf = llama_cpp.convert(llama, path, work)
    experts_per_token = json.loads((path / "config.json").read_text())["num_experts_per_tok"]
    return {"bench": str(llama.bench), "source": str(llama.source), "gguf": str(gguf),
            "flags": llama_cpp.working_flags(llama, gguf),
            "decode_weight_bytes": llama_cpp.decode_weight_bytes(llama, gguf, experts_per_token)}, ""


def run(args) -> int:
    from .report import machine, progress, write_csv

    path = Path(args.model) if args.model else None
    work = Path(tempfile.mkdtemp(prefix="ds4-bench-quant-"))  # deleted afterwards: a written checkpoint, a GGUF
    cuda = torch.device(args.device).type == "cuda"
    counts = args.threads or [torch.get_num_threads()]
    all_threads = os.cpu_count() or 1
    bar = progress((path is None) + 2 + len(MODES), "bench quant", unit="stage")
    if path is None:
        path = work / "checkpoint"
        bar.set_postfix_str(f"writing a real-size {args.layers}-layer, {args.experts}-expert checkpoint to {path}")
        write_checkpoint(path, real_size_config(args.layers, args.experts))
        bar.update()
    try:
        file_gib = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**30
        bar.set_postfix_str("converting the checkpoint with llama.cpp's converter (when a build is found)")
        llama, no_llama = _llama_peer(args, path, work / "llama.cpp")
        bar.update()
        bar.set_postfix_str("speed, both modes (and llama.cpp) and the read bandwidth at each thread count")
        timed = _child("speed", path, args.device, json.dumps({
            "threads": counts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "repeats": args.repeats, "llama": llama,
            "read_threads": [] if cuda else sorted({1, all_threads, *counts})}))
        speed, read_how = timed["speed"], timed["read_how"]
        bandwidth = {int(t): gb for t, gb in timed["read_gb_s"].items()}
        bar.update()
        memory = {}
        for mode in MODES:
            bar.set_postfix_str(f"memory, {mode}, in a process of its own")
            memory[mode] = _child("memory", path, args.device, json.dumps({"threads": counts[:1], "mode": mode}))
            bar.update()
        bar.close()
    finally:
        shutil.rmtree(work)
    rows = []
    for t in counts:
        for impl, r in speed[str(t)].items():
            weight_bytes = llama["decode_weight_bytes"] if impl == "llama.cpp" else memory[impl]["decode_weight_bytes"]
            row = {"quantized": impl, "threads": t, **(memory.get(impl) or {}), **r,
                   "decode_weight_bytes": weight_bytes,
                   "weight_gb_s": weight_bytes / r["decode_ms_per_token"] / 1e6}
            if bandwidth:  # the roofline: this run's read bandwidth at one thread and at all of them
                for key, n in (("1_thread", 1), ("all_threads", all_threads)):
                    row[f"read_gb_s_{key}"] = bandwidth[n]
                    row[f"of_read_{key}"] = row["weight_gb_s"] / bandwidth[n]
            rows.append(row)
    where = torch.cuda.get_device_name(torch.device(args.device)) if cuda else machine()
    print(f"bench quant: {args.model or 'a written checkpoint'} ({file_gib:.2f} GiB of safetensors), bf16, {where}, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, best of {args.repeats}")
    if bandwidth:
        print(f"read bandwidth ({read_how} over 1 GiB, timed between the decode runs): "
              + ", ".join(f"{t} thread{'s' * (t > 1)} {gb:.1f} GB/s" for t, gb in bandwidth.items()))
    all_label = f"of {all_threads}T read"
    print(f"{'impl':<11} {'threads':>7} {'decode ms/token':>16} {'prefill tok/s':>14} {'weights GB/s':>13} "
          f"{'of 1T read':>11} {all_label:>11}")
    for r in rows:
        fractions = [f"{100 * r[k]:.0f}%" if k in r else "-" for k in ("of_read_1_thread", "of_read_all_threads")]
        print(f"{r['quantized']:<11} {r['threads']:>7} {r['decode_ms_per_token']:>16.1f} "
              f"{r['prefill_tokens_per_s']:>14.1f} {r['weight_gb_s']:>13.1f} {fractions[0]:>11} {fractions[1]:>11}")
    if llama is None:
        print(f"llama.cpp: not timed ({no_llama})")
    else:
        print(f"llama.cpp: {llama['bench']} on the GGUF its converter wrote ({llama['decode_weight_bytes'] / 1e9:.2f} GB a "
              f"decode step reads){'; llama-bench ' + ' '.join(llama['flags']) if llama['flags'] else ''}")
    peak_label = "peak GPU GiB" if cuda else "peak RSS GiB"
    print(f"{'quantized':<11} {'tensor GiB':>11} {'bytes/param':>12} {'layers bytes/param':>19} {peak_label:>13}")
    for mode in MODES:
        m = memory[mode]
        print(f"{mode:<11} {m['tensor_gib']:>11.2f} {m['bytes_per_parameter']:>12.3f} "
              f"{m['layer_bytes_per_parameter']:>19.3f} {m['peak_gib']:>13.2f}")
    by = {(r["quantized"], r["threads"]): r for r in rows}
    for t in counts:
        keep, dense = by[("keep", t)], by[("dequantize", t)]
        line = (f"threads {t}: keep / dequantize: decode {keep['decode_ms_per_token'] / dense['decode_ms_per_token']:.2f}x "
                f"the ms/token, prefill {keep['prefill_tokens_per_s'] / dense['prefill_tokens_per_s']:.2f}x the tokens/s")
        if ("llama.cpp", t) in by:
            peer = by[("llama.cpp", t)]
            line += (f"; keep / llama.cpp: decode {keep['decode_ms_per_token'] / peer['decode_ms_per_token']:.2f}x "
                     f"the ms/token (target <= 1.0x), prefill "
                     f"{keep['prefill_tokens_per_s'] / peer['prefill_tokens_per_s']:.2f}x the tokens/s")
        print(line)
    if len(counts) > 1:
        first = counts[0]
        for impl in dict.fromkeys(r["quantized"] for r in rows):
            speedups = ", ".join(f"{t} threads {by[(impl, first)]['decode_ms_per_token'] / by[(impl, t)]['decode_ms_per_token']:.2f}x"
                                 for t in counts[1:])
            print(f"{impl} decode against {first} thread{'s' * (first > 1)}: {speedups}")
    same = [by[("keep", t)]["tokens"] == by[("dequantize", t)]["tokens"] for t in counts]
    m_keep, m_dense = memory["keep"], memory["dequantize"]
    line = (f"keep / dequantize memory {m_keep['tensor_gib'] / m_dense['tensor_gib']:.2f}x; same greedy tokens: "
            + ", ".join(f"{'yes' if ok else 'no'}" + (f" at {t} thread{'s' * (t > 1)}" if len(counts) > 1 else "")
                        for t, ok in zip(counts, same)))
    if len({tuple(by[("keep", t)]["tokens"]) for t in counts}) > 1:
        # torch's dense prefill products (oneDNN) sum in another order at another thread count
        line += " (the tokens differ between thread counts: torch's dense prefill products round differently)"
    print(line)
    if cuda:
        import triton

        peak = triton.testing.get_dram_gbps(torch.device(args.device).index or 0)
        print(f"weights GB/s against the device's peak {peak:,.0f} GB/s: "
              + ", ".join(f"{r['quantized']} {100 * r['weight_gb_s'] / peak:.0f}%" for r in rows))
    print("(weights GB/s: the weight bytes a decode step reads at least, as stored (top-k experts a layer; "
          f"llama.cpp: its GGUF's tensors), per decode time; of 1T / {all_threads}T read: that against this run's "
          f"read bandwidth at one thread / at all {all_threads}; layers bytes/param: the transformer layers alone, "
          "without the bf16 embedding and head; peak RSS counts the safetensors pages mapped while loading)")
    if args.csv:
        write_csv([{k: v for k, v in r.items() if k != "tokens"} for r in rows], args.csv)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        kind, path, device, options = argv[1:5]
        options = json.loads(options)
        if kind == "memory":
            torch.set_num_threads(options["threads"][0])
            print(json.dumps(measure_memory(path, options["mode"], device)))
        else:
            print(json.dumps(measure_speed(path, options["prompt_len"], options["new_tokens"], options["repeats"], device,
                                           options["threads"], options["llama"], options["read_threads"])))
        return 0
    if argv[:1] == ["--write"] and len(argv) >= 2:
        layers, experts = (int(a) for a in (argv[2:4] + ["1", "16"][len(argv[2:4]):]))
        print(write_checkpoint(argv[1], real_size_config(layers, experts)))
        return 0
    print("usage: python -m ds4_torch.bench.quant --write DIR [LAYERS [EXPERTS]]   (or: ds4-torch bench quant)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
