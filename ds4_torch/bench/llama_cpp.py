"""llama.cpp as the optional peer of `ds4-torch bench quant`: find a build, convert the benchmark's
checkpoint with llama.cpp's own converter, time it with its `llama-bench`.

What counts as a build: `--llama-cpp PATH` naming the `llama-bench` binary, a directory holding it
(`bin/`, `build/bin/`), or a source checkout built in `build/`; without the option, `llama-bench`
on PATH. The converter (`convert_hf_to_gguf.py`, with its `gguf-py`) comes from the source tree
the binary was built from (found upwards from it, or through the build's CMakeCache.txt). How
to build one: docs/performance.md.

The conversion is llama.cpp's own for DeepSeek-V4 (`deepseek4`): FP8 linears dequantized and
stored Q8_0, FP4 experts repacked losslessly to MXFP4, bf16 tensors (the head) kept bf16. Two
things the benchmark's checkpoint lacks are supplied, neither of which touches a weight: the
upstream config keys the converter reads (`compress_ratios`, `qk_rope_head_dim`, ...), derived
from the DS4 config, and a tokenizer (byte-level, 256 tokens; the converter pads the vocabulary
to `vocab_size`; one merge, since llama.cpp refuses a BPE vocabulary without), whose pre-tokenizer the converter is told is DeepSeek-V3's (it recognises
tokenizers by hashing their output on a test string, and this one is not a real model's).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CONVERTER = "convert_hf_to_gguf.py"


@dataclass(frozen=True)
class LlamaCpp:
    bench: Path   # the llama-bench binary
    source: Path  # the source tree: convert_hf_to_gguf.py, gguf-py/


def find(path: str | None) -> tuple[LlamaCpp | None, str]:
    """(the build, "") or (None, why there is none)."""
    if path:
        p = Path(path).expanduser()
        candidates = [p] if p.is_file() else [p / "llama-bench", p / "bin" / "llama-bench",
                                              p / "build" / "bin" / "llama-bench"]
        bench = next((c for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)
        if bench is None:
            return None, f"no llama-bench at {p} (looked for {', '.join(str(c) for c in candidates)})"
    else:
        found = shutil.which("llama-bench")
        if found is None:
            return None, "no llama.cpp build: pass --llama-cpp PATH or put llama-bench on PATH (docs/performance.md)"
        bench = Path(found)
    bench = bench.resolve()
    source = _source_tree(bench)
    if source is None:
        return None, f"found {bench}, but not the llama.cpp source it was built from ({CONVERTER} upwards of it)"
    return LlamaCpp(bench, source), ""


def _source_tree(bench: Path) -> Path | None:
    for parent in bench.parents:
        if (parent / CONVERTER).is_file():
            return parent
        cache = parent / "CMakeCache.txt"
        if cache.is_file():
            match = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.+)$", cache.read_text(errors="replace"), re.M)
            if match and (Path(match[1]) / CONVERTER).is_file():
                return Path(match[1])
    return None


# --------------------------------------------------------------------------- conversion
def _upstream_config(config: dict) -> dict:
    """The DS4 config.json plus the keys of DeepSeek's upstream config.json that llama.cpp's
    converter reads under their upstream names."""
    rates = config.get("compress_rates", {})
    extra = {
        "qk_rope_head_dim": round(config["head_dim"] * config.get("partial_rotary_factor", 1.0)),
        "compress_ratios": [rates.get(kind, 0) for kind in config["layer_types"]],
        "num_hash_layers": sum(kind == "hash_moe" for kind in config["mlp_layer_types"]),
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
    }
    return {**config, **{k: v for k, v in extra.items() if k not in config}}


def _write_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer: the 256 byte tokens and one merge (llama.cpp wants merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["\u0120t"] = len(vocab)  # " t"
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("\u0120", "t")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


_LAUNCHER = """
import runpy, sys
source = sys.argv[1]
sys.path[:0] = [source, source + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "deepseek-v3"
sys.argv = [source + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(source + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(llama: LlamaCpp, checkpoint: Path, work: Path) -> Path:
    """`checkpoint` (upstream layout, as `bench quant` writes it) -> a GGUF in `work`."""
    view = work / "hf"
    view.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.glob("*.safetensors*"):  # the shards and their index, as they are
        (view / f.name).unlink(missing_ok=True)
        (view / f.name).symlink_to(f.resolve())
    config = json.loads((checkpoint / "config.json").read_text())
    (view / "config.json").write_text(json.dumps(_upstream_config(config), indent=1))
    _write_tokenizer(view)
    out = work / "model.gguf"
    run = subprocess.run([sys.executable, "-c", _LAUNCHER, str(llama.source), str(view), "--outfile", str(out)],
                         capture_output=True, text=True)
    if run.returncode != 0 or not out.is_file():
        raise RuntimeError(f"llama.cpp's converter failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    return out


def decode_weight_bytes(llama: LlamaCpp, gguf: Path, experts_per_token: int) -> int:
    """Bytes a decode step reads at least, as `bench quant` counts its own: every tensor but the
    token embedding, the routed experts' (`*_exps`) by top-k of their count."""
    script = """
import json, sys
sys.path.insert(0, sys.argv[1] + "/gguf-py")
import gguf
reader = gguf.GGUFReader(sys.argv[2])
print(json.dumps([(t.name, int(t.n_bytes), [int(d) for d in t.shape]) for t in reader.tensors]))
"""
    run = subprocess.run([sys.executable, "-c", script, str(llama.source), str(gguf)], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"reading {gguf} failed:\n{run.stderr[-2000:]}")
    total = 0
    for name, nbytes, shape in json.loads(run.stdout):
        if name.startswith("token_embd"):
            continue
        total += nbytes * experts_per_token // shape[-1] if "_exps" in name else nbytes
    return total


# --------------------------------------------------------------------------- timing
# llama-bench's own settings, first that runs: its defaults; else without repacking weights into
# its CPU extra buffers (AMX / interleaved layouts), which on a CPU with AMX leaves some of the
# deepseek4 graph's ops on no backend (GGML_ASSERT(*cur_backend_id != -1) in this version).
SETTINGS = ([], ["--repack", "0"])


def _run(llama: LlamaCpp, gguf: Path, threads: int, prompt_len: int, new_tokens: int, flags: list[str]):
    cmd = [str(llama.bench), "-m", str(gguf), "-t", str(threads), "-p", str(prompt_len), "-n", str(new_tokens),
           "-r", "1", "-o", "json", *flags]
    return cmd, subprocess.run(cmd, capture_output=True, text=True, env=peer_environment())


def peer_environment() -> dict:
    """This process's environment as the user gave it: without the OpenMP wait policy ds4_torch
    chose for itself (its __init__), so that llama.cpp runs as its own users run it."""
    import ds4_torch

    env = dict(os.environ)
    if ds4_torch.OMP_WAIT_POLICY_DEFAULTED:
        env.pop("OMP_WAIT_POLICY", None)
    return env


def working_flags(llama: LlamaCpp, gguf: Path) -> list[str]:
    """The first of `SETTINGS` with which llama-bench runs this GGUF (a short run)."""
    errors = []
    for flags in SETTINGS:
        cmd, run = _run(llama, gguf, 1, 4, 1, flags)
        if run.returncode == 0:
            return flags
        errors.append(f"{' '.join(cmd)} (exit {run.returncode}): {run.stderr[-800:]}")
    raise RuntimeError("llama-bench cannot run the converted checkpoint:\n" + "\n".join(errors))


def time_once(llama: LlamaCpp, gguf: Path, threads: int, prompt_len: int, new_tokens: int,
              flags: list[str] = ()) -> dict:
    """One llama-bench run (-r 1): decode ms/token (its tg test) and prefill tokens/s (pp)."""
    cmd, run = _run(llama, gguf, threads, prompt_len, new_tokens, list(flags))
    if run.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit {run.returncode}): {' '.join(cmd)}\n{run.stderr[-3000:]}")
    tests = json.loads(run.stdout)
    tg = next(t for t in tests if t["n_gen"] > 0)
    pp = next(t for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0)
    return {"decode_ms_per_token": 1e3 / tg["avg_ts"], "prefill_tokens_per_s": pp["avg_ts"]}
