"""Every Triton kernel compiles for sm_80 and sm_90 at V4-Flash sizes (no GPU needed) within the
hardware's limits (registers per thread and per block, no spills, shared memory per block); the
resource report is written as CSV to the path given to the child (a temporary directory here).
The attention and indexer kernels compile over a static cache's rows and over a paged cache's
pool (PAGED) alike.

How: the launchers in `triton_kernels` are run on meta tensors at V4-Flash sizes with each kernel
swapped for a recorder, so the compile sees exactly the arguments, block sizes and warps a real
launch would. Each launch becomes `triton.compile(ASTSource(kernel, signature, constexprs, attrs),
target=GPUTarget("cuda", cc, 32))`, specialised the way the JIT specialises (ints equal to 1
become constants, pointers and multiples of 16 get divisibility 16).

Why a subprocess: this test session sets TRITON_INTERPRET=1 before triton is imported, which
turns triton's own standard library (tl.sum, tl.max, ... are @triton.jit functions) into
interpreter functions. Compiling then fails, even from `kernel.fn` re-wrapped in a JITFunction
("'ir.value' object has no attribute 'data'" in tl.sum), and flipping the variable back at
compile time breaks triton's gluon import. So the compile runs in a child process whose
environment has no TRITON_INTERPRET (this file is also the child's script).

Registers and spills: `CompiledKernel.metadata` has no register count without a driver (n_regs
and n_spills are filled when the cubin is loaded on a GPU), so they are parsed from the
`ptxas -v` log of triton's own ptxas call (the ptxas shipped in triton/backends/nvidia/bin),
printed by setting `knobs.nvidia.dump_ptxas_log`. Shared memory is `metadata.shared` (triton
allocates it dynamically, so ptxas reports none).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGETS = (80, 90)
# Hardware limits (CUDA programming guide, compute capability 8.0 and 9.0): opt-in shared memory
# per block A100 163 KiB, H100 227 KiB; at most 255 registers per thread; 64K 32-bit registers
# per block; 32 threads per warp.
MAX_SHARED = {80: 163 * 1024, 90: 227 * 1024}
MAX_REGISTERS_PER_THREAD = 255
MAX_REGISTERS_PER_BLOCK = 65536
FIELDS = ["case", "kernel", "target", "num_warps", "num_stages", "blocks", "registers", "spill_stores",
          "spill_loads", "shared_bytes", "tensor_cores", "compile_s"]


def test_kernels_compile_for_sm80_and_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    report = tmp_path / "kernel_compile.csv"
    child = subprocess.run([sys.executable, __file__, str(report)], env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=900)
    assert child.returncode == 0, f"kernel compile failed:\n{child.stdout[-4000:]}\n{child.stderr[-8000:]}"
    rows = list(csv.DictReader(report.open()))
    cases = {(r["case"], r["kernel"]) for r in rows}
    assert {r["target"] for r in rows} == {f"sm_{cc}" for cc in TARGETS}
    assert len(rows) == len(cases) * len(TARGETS)
    assert {k for _, k in cases} == {"_attention_partial_kernel", "_attention_merge_kernel",
                                     "_compress_rows_kernel", "_indexer_keys_kernel", "_sinkhorn_kernel",
                                     "_fp8_linear_kernel"}
    for r in rows:
        cc = int(r["target"][3:])
        assert int(r["shared_bytes"]) <= MAX_SHARED[cc], r  # else OutOfResources at the first launch
        registers, threads = int(r["registers"]), 32 * int(r["num_warps"])
        assert 0 < registers <= MAX_REGISTERS_PER_THREAD, r
        assert registers * threads <= MAX_REGISTERS_PER_BLOCK, r  # else the launch fails
        assert int(r["spill_stores"]) == 0 and int(r["spill_loads"]) == 0, r  # spills go to local memory: slow
        if "bf16" in r["case"] and r["kernel"] in ("_attention_partial_kernel", "_indexer_keys_kernel",
                                                   "_fp8_linear_kernel"):
            assert r["tensor_cores"] == "True", r  # bf16 dots must reach mma / wgmma


# --------------------------------------------------------------------------- child process
def v4_flash_launches():
    """(case, kernel, args, kwargs) of every kernel launch at V4-Flash sizes, recorded from the
    real launchers on meta tensors."""
    import torch

    from ds4_torch.kernels import triton_kernels as tk
    from ds4_torch.kernels import triton_quantized as tq

    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((case, self.kernel, args, kwargs))

    for name in ("_attention_partial_kernel", "_attention_merge_kernel", "_compress_rows_kernel",
                 "_indexer_keys_kernel", "_sinkhorn_kernel"):
        setattr(tk, name, Recorder(getattr(tk, name)))
    tq._fp8_linear_kernel = Recorder(tq._fp8_linear_kernel)

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    H, D, W, K, HI, DI, ROPE = 64, 512, 128, 512, 64, 128, 64  # V4-Flash
    context = 65536
    c_csa, c_hca = context // 4, context // 128
    start = meta(1, dtype=torch.int64)
    sinks = meta(H, dtype=torch.float32)
    for case, T, C, sel, rate, dtype in (
        ("csa_decode_bf16", 1, c_csa, True, 4, torch.bfloat16),
        ("hca_decode_bf16", 1, c_hca, False, 128, torch.bfloat16),
        ("csa_prefill_bf16", 512, c_csa, True, 4, torch.bfloat16),
        ("hca_decode_fp32", 1, c_hca, False, 128, torch.float32),
    ):
        comp_sel = meta(1, T, K, dtype=torch.int64) if sel else None
        tk.attention(meta(1, T, H, D, dtype=dtype), meta(1, W, D, dtype=dtype), meta(1, T, D, dtype=dtype), start,
                     meta(1, C, D, dtype=dtype), comp_sel, rate, sinks, D ** -0.5)
    # key rows whose offsets pass 2^31 (a compressed cache viewed with a 2^20-element row stride):
    # the int64 key-offset variant
    case = "csa_prefill_bf16_wide_keys"
    wide_comp = torch.empty_strided((1, c_csa, D), (c_csa << 20, 1 << 20, 1), dtype=torch.bfloat16, device="meta")
    tk.attention(meta(1, 512, H, D), meta(1, W, D), meta(1, 512, D), start, wide_comp,
                 meta(1, 512, K, dtype=torch.int64), 4, sinks, D ** -0.5)
    # Paged caches: the compressed rows in one pool of 256-token blocks [P, D] (P = rows of every
    # block + a scratch row), each sequence's row w at pool row comp_slots[b, w]. 64 sessions of 64K
    # tokens: 2^20 CSA rows, offsets within int32; a 4x larger pool passes 2^31: the int64 variant.
    batch = 16
    for case, T, pool_rows, C, sel, rate, dtype in (
        ("csa_decode_bf16_paged", 1, 64 * c_csa + 1, c_csa, True, 4, torch.bfloat16),
        ("hca_decode_bf16_paged", 1, 64 * c_hca + 1, c_hca, False, 128, torch.bfloat16),
        ("hca_decode_fp32_paged", 1, 64 * c_hca + 1, c_hca, False, 128, torch.float32),
        ("csa_prefill_bf16_paged_wide_pool", 512, 256 * c_csa + 1, c_csa, True, 4, torch.bfloat16),
    ):
        B = 1 if T > 1 else batch
        slots = meta(B, C + 1, dtype=torch.int64)[:, :C]  # the model passes the first C columns
        comp_sel = meta(B, T, K, dtype=torch.int64) if sel else None
        tk.attention(meta(B, T, H, D, dtype=dtype), meta(B, W, D, dtype=dtype), meta(B, T, D, dtype=dtype),
                     meta(B, dtype=torch.int64), meta(pool_rows, D, dtype=dtype), comp_sel, rate, sinks, D ** -0.5,
                     slots)
    case = "indexer_decode_bf16_paged"
    tk.indexer_keys(meta(batch, 1, HI, DI), meta(batch, 1, HI, dtype=torch.float32), meta(64 * c_csa + 1, DI),
                    meta(batch, dtype=torch.int64), 4, meta(batch, c_csa + 1, dtype=torch.int64)[:, :c_csa])
    for case, S, width in (("csa_compressor_bf16", 8, D), ("hca_compressor_bf16", 128, D),
                           ("indexer_compressor_bf16", 8, DI)):
        tk.compress_rows(meta(1, 1, S, width), meta(1, 1, S, width), meta(width), 1e-6,
                         meta(1, 1, ROPE // 2), meta(1, 1, ROPE // 2))
    case = "indexer_decode_bf16"
    tk.indexer_keys(meta(1, 1, HI, DI), meta(1, 1, HI, dtype=torch.float32), meta(1, c_csa, DI), start, 4)
    for case, tokens in (("mhc_decode_fp32", 64), ("mhc_prefill_fp32", 8192)):  # 4 streams, 20 iterations
        tk.sinkhorn(meta(tokens, 4, 4, dtype=torch.float32), 20, 1e-6)
    # ds4::fp8_linear: q_b_proj (1024 -> 32768) in decode, wo_b (8192 -> 4096) in a prefill; e8m0 scales
    for case, N, R, K, dtype in (("fp8_linear_decode_bf16", 1, H * D, 1024, torch.bfloat16),
                                 ("fp8_linear_prefill_bf16", 512, 4096, 8192, torch.bfloat16),
                                 ("fp8_linear_decode_fp32", 1, H * D, 1024, torch.float32)):
        tq.fp8_linear(meta(N, K, dtype=dtype), meta(R, K, dtype=torch.float8_e4m3fn),
                      meta(R // 128, K // 128, dtype=torch.uint8), 128, 128)
    return launches


def specialise(kernel, args, kwargs):
    """(signature, constexprs, attrs, options) as the JIT would build them for this launch."""
    import torch

    pointer = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
               torch.int32: "*i32", torch.uint8: "*u8"}
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = {**dict(zip(kernel.arg_names, args)), **kwargs}
    signature, constexprs, attrs = {}, {}, {}
    for idx, name in enumerate(kernel.arg_names):
        value = values[name]
        if torch.is_tensor(value):
            signature[name] = pointer[value.dtype]
            attrs[(idx,)] = [["tt.divisibility", 16]]  # torch allocations are 256-byte aligned
        elif name in kwargs or (type(value) is int and value == 1):  # declared or specialised constant
            signature[name], constexprs[name] = "constexpr", value
        elif type(value) is int:
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(idx,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    return signature, constexprs, attrs, options


def compile_launches(launches) -> list[dict]:
    """Compile each recorded (case, kernel, args, kwargs) launch for sm_80 and sm_90; one row of
    resources per kernel and target. Launches whose specialisation (signature, constexprs,
    divisibility, warps, stages) is the same compile to the same binary, so they are compiled once
    and the row repeated under each case. Shared with the other kernels' compile tests (test_moe)."""
    import contextlib
    import io
    import re
    import time

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    knobs.nvidia.dump_ptxas_log = True  # triton prints its `ptxas -v` log: registers and spills
    knobs.compilation.always_compile = True  # a cache hit would skip ptxas, and with it the log
    rows = []
    compiled_rows = {}  # (kernel, specialisation, target) -> its row: launches that specialise alike share a build
    for case, kernel, args, kwargs in launches:
        signature, constexprs, attrs, options = specialise(kernel, args, kwargs)
        blocks = " ".join(f"{k}={v}" for k, v in constexprs.items() if k.startswith("BLOCK"))
        for cc in TARGETS:
            key = (kernel, repr((signature, constexprs, attrs, options)), cc)
            if key in compiled_rows:
                rows.append({**compiled_rows[key], "case": case})
                continue
            log = io.StringIO()
            began = time.perf_counter()
            with contextlib.redirect_stdout(log):
                compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                          target=GPUTarget("cuda", cc, 32), options=options)
            seconds = time.perf_counter() - began
            text = log.getvalue()
            registers = re.search(r"Used (\d+) registers", text)
            spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
            assert registers and spills, f"no ptxas -v log for {case} {kernel.__name__}:\n{text}"
            rows.append(dict(
                case=case, kernel=kernel.__name__, target=f"sm_{cc}", num_warps=compiled.metadata.num_warps,
                num_stages=compiled.metadata.num_stages, blocks=blocks, registers=int(registers.group(1)),
                spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)),
                shared_bytes=compiled.metadata.shared,
                tensor_cores=bool(re.search(r"\b(wgmma|mma)\.", compiled.asm["ptx"])), compile_s=round(seconds, 1)))
            compiled_rows[key] = rows[-1]
    return rows


def compile_report(report: Path):
    rows = compile_launches(v4_flash_launches())
    with report.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("compile the kernels with TRITON_INTERPRET unset (see the module docstring)")
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} REPORT.csv")
    compile_report(Path(sys.argv[1]))
