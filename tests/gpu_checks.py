"""The GPU suite's checks, run by `test_gpu.py` as child processes with TRITON_INTERPRET unset
(the test session sets it before triton is imported, which makes every kernel an interpreted one).
Each check raises on the first mismatch and prints one `ok` line per part it passed.

    python tests/gpu_checks.py kernels | graph | model | bench | quant | speculative
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

from helpers import assert_close

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEVICE = torch.device("cuda")

# V4-Flash sizes, on top of test_kernels' small cases: the block shapes (16-head tiles, 512-wide
# rows, 8 or 16 warps) only taken at D >= 256, several key blocks per split, many row tiles.
# (name, B, T, H, D, W, C, rate, starts, K or None for HCA)
FLASH_ATTENTION = [
    ("flash_csa_decode_16k", 1, 1, 64, 512, 128, 4096, 4, [16382], 512),
    ("flash_csa_decode_batch", 3, 1, 64, 512, 128, 1024, 4, [5, 700, 4094], 512),
    ("flash_hca_decode_64k", 1, 1, 64, 512, 128, 512, 128, [65534], None),
    ("flash_hca_decode_window_filling", 2, 1, 64, 512, 128, 512, 128, [3, 127], None),
    ("flash_csa_prefill", 1, 16, 64, 512, 128, 1024, 4, [3000], 512),
]
# (name, B, J, S, D, R, first-half gates -inf)
FLASH_COMPRESS = [("flash_csa_rows", 1, 2, 8, 512, 64, True), ("flash_hca_rows", 1, 1, 128, 512, 64, False),
                  ("flash_indexer_rows", 2, 1, 8, 128, 64, False)]
# (name, B, T, Hi, dI, C, rate, starts, k)
FLASH_INDEXER = [("flash_indexer_decode_64k", 1, 1, 64, 128, 16384, 4, [65534], 512),
                 ("flash_indexer_prefill", 1, 8, 64, 128, 2048, 4, [8000], 512)]


def cuda(args):
    return [a.to(DEVICE) if torch.is_tensor(a) else a for a in args]


def assert_valid_topk(got, scores, start, rate, k, name):
    """`got` [B, T, k] is a top-k of the reference fp32 `scores` [B, T, C] up to rounding: the visible
    rows (w < (t+1)//rate) picked best first, -1 past them, and no unpicked visible row scoring
    above a picked one by more than 1e-5 of the largest score (random scores over thousands of rows
    have near-ties a different summation order may resolve either way)."""
    B, T, C = scores.shape
    tol = 1e-5 * scores.abs().max().item() if scores.numel() else 0.0
    for b in range(B):
        for t in range(T):
            n_visible = min(C, (int(start[b]) + t + 1) // rate)
            picks = got[b, t].tolist()
            want = min(k, n_visible)
            assert picks[want:] == [-1] * (k - want), (name, b, t, picks)
            chosen = picks[:want]
            assert len(set(chosen)) == want and all(0 <= r < n_visible for r in chosen), (name, b, t)
            s = scores[b, t, :n_visible]
            picked = s[chosen]
            assert (picked[:-1] >= picked[1:] - tol).all(), (name, "not best first", b, t)
            rest = torch.ones(n_visible, dtype=torch.bool)
            rest[chosen] = False
            if rest.any():
                assert picked.min() >= s[rest].max() - tol, (name, "a better row was left out", b, t)


def check_kernels():
    """Every Triton kernel, natively, in fp32, bf16 and fp16, against the torch reference in fp32
    on the same (already rounded) inputs: test_kernels' cases plus V4-Flash sizes."""
    import test_kernels as tkt
    from ds4_torch.kernels import reference
    from ds4_torch.kernels import triton_kernels as tk

    assert not tk.INTERPRETED, "the kernels must be compiled for the GPU, not interpreted"
    for case in tkt.ATTENTION_CASES + FLASH_ATTENTION:
        for dtype in DTYPES:
            args = tkt.attention_inputs(*case[1:], dtype)
            expected = reference.attention(*tkt.upcast(args))
            assert_close(tk.attention(*cuda(args)).cpu(), expected, dtype)
        print("ok attention", case[0])
    for splits in (1, 2, 3, 5, 9):
        args = tkt.attention_inputs(2, 1, 2, 16, 8, 120, 2, [250, 37], None, torch.float32)
        assert_close(tk.attention(*cuda(args), num_splits=splits).cpu(), reference.attention(*args), torch.float32)
    print("ok attention split counts")

    for _, B, J, S, D, R, masked in tkt.COMPRESS_CASES + FLASH_COMPRESS:
        for dtype in DTYPES:
            kv, gate = tkt.randn(B, J, S, D, seed=1, dtype=dtype), tkt.randn(B, J, S, D, seed=2, dtype=dtype)
            if masked:
                gate[..., : S // 2, : D // 2] = float("-inf")
            weight = 1 + 0.2 * tkt.randn(D, seed=3, dtype=dtype)
            angles = tkt.randn(B, J, R // 2, seed=4) * 3
            args = (kv, gate, weight, 1e-6, angles.cos().to(dtype), angles.sin().to(dtype))
            assert_close(tk.compress_rows(*cuda(args)).cpu(), reference.compress_rows(*tkt.upcast(args)), dtype)
    print("ok compress_rows")

    for case in tkt.INDEXER_CASES + FLASH_INDEXER:
        for dtype in DTYPES:
            args = tkt.indexer_inputs(*case[1:], dtype)
            q, w, rows, start, rate, k = tkt.upcast(args)
            got = tk.indexer_topk(*cuda(args)).cpu()
            scores = reference.indexer_scores(q, w, rows)
            assert_valid_topk(got, scores, start, rate, min(k, rows.shape[1]), case[0])
            top = scores.masked_fill(~reference.visible_rows(start, q.shape[1], rows.shape[1], rate),
                                     float("-inf")).sort(dim=-1, descending=True).values
            if 0 < k < rows.shape[1] and ((top[..., k - 1] - top[..., k] > 1e-4) | ~torch.isfinite(top[..., k])).all():
                # no near-tie at the k-th place: the picks are well defined, and must be the reference's
                assert got.tolist() == reference.indexer_topk(q, w, rows, start, rate, k).tolist(), (case[0], dtype)
        print("ok indexer_topk", case[0])
    tkt_tie = tkt.test_indexer_boundary_tie_lower_index_wins
    original = tk.indexer_topk
    tk.indexer_topk = lambda *a: original(*cuda(a)).cpu()  # the same tie test, on the GPU
    try:
        tkt_tie()
    finally:
        tk.indexer_topk = original
    print("ok indexer tie rule (lower index wins)")


def check_graph():
    """A real CUDA-graph capture of the decode step, replayed step after step across window fill
    and hundreds of ring wraps, every emit phase of both rates, the first compressed rows and the
    indexer's activation (visible rows > top-k), for one sequence and a batch at staggered
    positions: the same tokens and logits as eager decoding on the same GPU."""
    from ds4_torch import DS4Config, DS4ForCausalLM
    from ds4_torch.decode import make_decoder, prefill
    from oracle import randomise
    from test_decode import SMALL, greedy

    model = DS4ForCausalLM(DS4Config.from_dict(SMALL))
    randomise(model, 3)
    model = model.to(DEVICE).eval()
    prompt_len, steps = 23, 400
    ids = torch.randint(2, 64, (1, prompt_len), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    results = {}
    with torch.no_grad():
        for mode in ("eager", "graph"):
            cache = model.new_cache(1, prompt_len + steps)
            decoder = make_decoder(model, cache, mode)
            assert decoder.mode == mode
            if mode == "graph":
                assert decoder.backend == "cuda", decoder.backend
            results[mode] = greedy(decoder, prefill(model, cache, ids, 8), steps)
    assert torch.equal(results["eager"][0], results["graph"][0])
    assert (results["eager"][1] - results["graph"][1]).abs().max().item() <= 1e-5
    total = prompt_len + steps
    assert total > 50 * SMALL["sliding_window"] and total // 2 > SMALL["index_topk"]
    print("ok cuda graph decode, one sequence,", steps, "steps")

    prompt_lens, steps = (2, 9, 17), 60
    out = {}
    with torch.no_grad():
        for mode in ("eager", "graph"):
            cache, first = model.new_cache(3, 96), []
            for i, n in enumerate(prompt_lens):
                single = model.new_cache(1, 96)
                seq = torch.randint(2, 64, (1, n), generator=torch.Generator().manual_seed(n)).to(DEVICE)
                first.append(prefill(model, single, seq, 8))
                cache.copy_sequence(i, 0, single)
            out[mode] = greedy(make_decoder(model, cache, mode), torch.cat(first), steps)
    assert torch.equal(out["eager"][0], out["graph"][0])
    assert (out["eager"][1] - out["graph"][1]).abs().max().item() <= 1e-5
    print("ok cuda graph decode, batch of 3 at staggered positions")


def check_model():
    """The model on the GPU (Triton kernels) against transformers (fp32 on the CPU, the oracle):
    a stateless forward, and a chunked prefill followed by decode steps past the window and many
    compressions, logits within 1e-4."""
    from ds4_torch import DS4ForCausalLM
    from ds4_torch.kernels import kernel_for
    from oracle import hf_logits_incremental, make_oracle

    assert kernel_for("auto", DEVICE) == "triton"
    with tempfile.TemporaryDirectory() as tmp:
        from pathlib import Path

        hf, path = make_oracle(Path(tmp), seed=4)
        ours = DS4ForCausalLM.from_pretrained(path, dtype=torch.float32, device=DEVICE)
        ids = torch.randint(2, 101, (1, 48), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            diff = (ours(ids.to(DEVICE)).cpu() - hf(ids).logits).abs().max().item()
            assert diff <= 1e-4, f"stateless forward: {diff}"
            print(f"ok stateless forward on CUDA vs transformers: {diff:.2e}")
            prompt, steps = 9, 48
            ids = torch.randint(2, 101, (1, prompt + steps), generator=torch.Generator().manual_seed(3))
            expected = hf_logits_incremental(hf, ids, [prompt] + [1] * steps)
            cache = ours.new_cache(1, 80)
            got = [ours(ids[:, :prompt].to(DEVICE), cache=cache).cpu()]
            got += [ours(ids[:, t:t + 1].to(DEVICE), cache=cache).cpu() for t in range(prompt, prompt + steps)]
            diff = (torch.cat(got, 1) - expected).abs().max().item()
            assert diff <= 1e-4, f"prefill + decode: {diff}"
            print(f"ok prefill + {steps} decode steps on CUDA vs transformers: {diff:.2e}")


def check_bench():
    """`ds4-torch bench kernels` runs and reports every kernel in GB/s against the peak."""
    import contextlib
    import io

    from ds4_torch.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", "kernels", "--contexts", "65536", "--dtypes", "bfloat16", "float32"])
    text = out.getvalue()
    print(text)
    assert rc == 0
    assert "peak DRAM bandwidth" in text and "CSA decode at 65536" in text
    for kernel in ("attention CSA", "attention HCA", "compress_rows", "indexer scan + top-k"):
        assert kernel in text, kernel
    print("ok bench kernels")


def check_quant():
    """The quantized-weight kernels natively: ds4::fp8_linear at V4-Flash shapes and the MoE
    reading packed FP4/FP8 experts, in every dtype, against the torch implementations on the same
    packed weights (float64 for fp8_linear), and the op free of host syncs."""
    from ckpt_utils import fp8_quantize, fp8_reference
    from ds4_torch.kernels import triton_quantized as tq
    from ds4_torch.kernels.moe import moe_torch
    from test_moe import LIMIT, make_inputs, quantized_experts

    assert not tq.INTERPRETED, "the kernels must be compiled for the GPU, not interpreted"
    g = torch.Generator().manual_seed(0)
    for name, R, K, fmt in (("q_b_proj", 32768, 1024, "e8m0"), ("wo_b", 4096, 8192, "uint8"),
                            ("odd", 300, 200, "float32")):
        q, s = fp8_quantize(torch.randn(R, K, generator=g), fmt)
        dense = fp8_reference(q, s).double()
        for N in (1, 7, 300):
            for dtype in DTYPES:
                x = torch.randn(N, K, generator=g).to(dtype)
                got = torch.ops.ds4.fp8_linear(*cuda((x, q, s)), 128, 128, "auto")
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                torch.ops.ds4.fp8_linear(*cuda((x, q, s)), 128, 128, "auto")
                torch.cuda.set_sync_debug_mode("default")
                assert_close(got.cpu(), x.double() @ dense.T, dtype)
        print("ok fp8_linear", name)
    for fmt in ("fp4", "fp8"):
        for N in (1, 64):
            hidden, ids, weights, gate_up, down = make_inputs(N, 6, 16, 4096, 2048, seed=N)
            packed, _ = quantized_experts(gate_up, down, fmt)
            for dtype in DTYPES[1:]:
                args = (hidden.to(dtype), ids, weights.to(dtype))
                expected = moe_torch(*args, *packed[:2], LIMIT, *packed[2:])
                got = torch.ops.ds4.moe(*cuda(args), *cuda(packed[:2]), LIMIT, "auto", *cuda(packed[2:]))
                assert_close(got.cpu(), expected.double(), dtype)
        print("ok moe packed", fmt)

    # bench quant on the GPU, at small sizes: peak GPU memory and weight GB/s against the peak
    import contextlib
    import io

    from ds4_torch.bench.quant import write_checkpoint
    from ds4_torch.cli import main
    from test_quantized import small_config

    with tempfile.TemporaryDirectory() as directory:
        write_checkpoint(directory, small_config())
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(["bench", "quant", "--model", directory, "--device", "cuda", "--prompt-len", "8",
                       "--new-tokens", "3", "--repeats", "1"])
    print(out.getvalue())
    assert rc == 0 and "peak GPU GiB" in out.getvalue() and "against the device's peak" in out.getvalue()
    print("ok bench quant on cuda")


def check_speculative():
    """Speculative decoding on CUDA (Triton kernels): a batch of prompts, greedy, N = 1..3, with
    the forwards eager and as real CUDA graphs (one per fixed 1 + N shape): plain greedy's tokens
    and its verified logits (<= 1e-5, on the same GPU)."""
    from ds4_torch import DS4Config, DS4ForCausalLM
    from oracle import randomise
    from test_speculative import NEW, SMALL, plain_decode
    from test_speculative_paths import PROMPTS, speculate_batch

    model = DS4ForCausalLM(DS4Config.from_dict(SMALL))
    randomise(model, 3)
    model = model.to(DEVICE).eval()
    truth = [plain_decode(model, p, NEW) for p in PROMPTS]
    for n in (1, 2, 3):
        for mode in ("eager", "graph"):
            tokens, rows, spec = speculate_batch(model, PROMPTS, n, mode=mode)
            if mode == "graph":
                assert spec.forwards.backend == "cuda", spec.forwards.backend
            for (want, want_rows), got, got_rows in zip(truth, tokens, rows):
                assert got == want, (n, mode)
                assert (got_rows - want_rows).abs().max().item() <= 1e-5, (n, mode)
            assert 0 < spec.stats.accepted < spec.stats.drafted
            print(f"ok speculative {mode} N={n}")


def check_serve_speculative():
    """The server speculating on CUDA (`--speculative-tokens 2`, decode mode auto: captured CUDA
    graphs per power-of-two width): a batch of concurrent greedy requests gives the plain
    server's tokens, and drafts are accepted."""
    from ds4_torch.default_model import build_default_model
    from test_serve_speculative import PROMPTS, run_all

    model = build_default_model(device=DEVICE)
    requests = [dict(prompt=p, max_tokens=23 + 7 * i) for i, p in enumerate(PROMPTS)]
    plain, _, _ = run_all(model, 0, requests)
    spec, metrics, _ = run_all(model, 2, requests)
    assert [c["token_ids"] for c in spec] == [c["token_ids"] for c in plain]
    assert metrics.value("ds4_spec_accepted_tokens_total") > 0
    print("ok serve speculative on cuda")


CHECKS = {"serve_speculative": check_serve_speculative, "speculative": check_speculative, "kernels": check_kernels, "graph": check_graph, "model": check_model, "bench": check_bench,
          "quant": check_quant}

if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run the GPU checks with TRITON_INTERPRET unset (see the module docstring)")
    if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(CHECKS)}}}")
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (the oracle comparisons)
    torch.backends.cudnn.allow_tf32 = False
    CHECKS[sys.argv[1]]()
