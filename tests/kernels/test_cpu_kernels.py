"""The native CPU products (kernels/cpu_linear.py + cpu_linear.c): bf16, FP8 e4m3 with block scales
and FP4 e2m1 with e8m0 scales, against the dense product on weights dequantized by tests/ckpt_utils'
own reference, in float64; the same bits at 1 and 2 threads and at any batch size; the portable
builds (no AVX-512, with and without threads) and the torch path without a compiler; callers on
two threads at once and in a forked child; and a whole model kept
quantized against the same checkpoint dequantized.

Tolerances as tests/kernels/test_quantized.py: fp32 within 1e-5 of the output's largest magnitude, bf16
within 2^-7 of it (the output is rounded to bf16 once).
"""

from __future__ import annotations

import pytest
import torch

from ckpt_utils import fp4_quantize, fp8_quantize, fp8_reference
from ds4_torch import quant as Q
from ds4_torch.kernels import cpu_linear

TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}
ROWS = (1, 3, 16)


def assert_near(got, want, dtype):
    assert got is not None, "the native product did not run"
    scale = want.abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err <= TOL[dtype] * scale, f"{dtype}: max error {err:.3g} against output magnitude {scale:.3g}"


def native_available() -> bool:
    """With a C compiler the library must build (a failing build is a failure, not a skip)."""
    import os
    import shutil

    if shutil.which(os.environ.get("CC", "cc")) is None or os.environ.get("DS4_TORCH_NATIVE") == "0":
        return False
    assert cpu_linear.available(), "a C compiler is present but the native CPU linears did not build"
    return True


@pytest.fixture
def native():
    if not native_available():
        pytest.skip("no C compiler: the torch path serves (test_no_compiler_falls_back_to_torch covers it)")
    return cpu_linear


def weights(kind: str, R: int, K: int, seed: int, fmt: str = "e8m0", block: int = 128):
    """(stored weight tensors, dense float64 reference, call(x) of the native product)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(R, K, generator=g) * 3
    if kind == "bf16":
        wb = w.to(torch.bfloat16)
        return wb.double(), lambda x: cpu_linear.bf16_linear(x, wb)
    if kind == "fp8":
        q, s = fp8_quantize(w, fmt, block=block)
        return fp8_reference(q, s, block=block).double(), lambda x: cpu_linear.fp8_linear(x, q, s, block, block)
    packed, s, exact = fp4_quantize(w, fmt)
    return exact.double(), lambda x: cpu_linear.fp4_linear(x, packed, s)


# (kind, R, K, scale format, block): rows not a multiple of the 4-row tile, K not a multiple of
# the 32-column chunk nor of the 128-column block where the format allows (FP4: K % 32 == 0)
CASES = [
    ("bf16", 37, 200, None, None), ("bf16", 64, 4096 + 8, None, None),
    ("fp8", 300, 200, "e8m0", 128), ("fp8", 130, 129, "uint8", 128), ("fp8", 256, 384, "float32", 128),
    ("fp8", 100, 70, "e8m0", 32), ("fp8", 5, 1100, "e8m0", 128),
    ("fp4", 37, 96, "e8m0", None), ("fp4", 130, 1056, "uint8", None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-{c[3]}-{c[4]}")
@torch.no_grad()
def test_products_match_the_dequantized_weight(native, case):
    kind, R, K, fmt, block = case
    dense, product = weights(kind, R, K, seed=R + K, fmt=fmt or "e8m0", block=block or 128)
    g = torch.Generator().manual_seed(1)
    for n in ROWS:
        x = torch.randn(n, K, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            got = product(xd)
            assert got.dtype == dtype and got.shape == (n, R)
            assert_near(got, xd.double() @ dense.T, dtype)
    x3 = torch.randn(2, 3, K, generator=g)  # leading dims kept
    assert product(x3).shape == (2, 3, R)


@torch.no_grad()
def test_fp8_special_bytes_decode_exactly(native):
    """Every e4m3 byte (zero, the subnormals m * 2^-9, both signs, 448) as a one-hot row of the weight:
    the product returns the byte's value itself; 0x7f / 0xff (NaN) give NaN, as dequantize does."""
    codes = torch.arange(256, dtype=torch.uint8)
    w = torch.zeros(256, 128, dtype=torch.uint8)
    w[:, 7] = codes
    w = w.view(torch.float8_e4m3fn)
    scale = torch.ones(2, 1)
    x = torch.zeros(1, 128)
    x[0, 7] = 1.0
    got = cpu_linear.fp8_linear(x, w, scale, 128, 128)[0]
    want = codes.view(torch.float8_e4m3fn).float()
    finite = want.isfinite()
    assert torch.equal(got[finite], want[finite])
    assert got[~finite].isnan().all() and (~finite).sum() == 2


@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp4"])
@torch.no_grad()
def test_same_bits_at_every_thread_count_and_batch_size(native, kind):
    """Rows are split over threads whole and each row's sums run in one order: 1 and 2 threads,
    and a row alone or among 16, give the same bits."""
    R, K = (512, 2048) if kind != "fp8" else (1024, 1024)  # enough weight for two threads
    _, product = weights(kind, R, K, seed=7)
    x = torch.randn(16, K, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = product(x)
        torch.set_num_threads(2)
        two = product(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert torch.equal(product(x[5:6]), one[5:6]) and torch.equal(product(x[3:7]), one[3:7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_prefill_tiles_unpack_exactly(native, dtype):
    """The one-pass unpacking behind prefill gives bit for bit what quant.dequantize gives."""
    g = torch.Generator().manual_seed(3)
    for fmt in ("e8m0", "uint8", "float32"):
        q, s = fp8_quantize(torch.randn(300, 1000, generator=g), fmt)
        out = torch.empty(300, 1000, dtype=dtype)
        assert cpu_linear.dequantize_fp8_rows(q, s, 128, 128, out)
        assert torch.equal(out, Q.dequantize(q, s, dtype)), fmt
    for fmt in ("e8m0", "uint8"):
        packed, s, _ = fp4_quantize(torch.randn(70, 544, generator=g) * 5, fmt)
        out = torch.empty(70, 544, dtype=dtype)
        assert cpu_linear.dequantize_fp4_rows(packed, s, out)
        assert torch.equal(out, Q.dequantize(packed, s, dtype)), fmt


@torch.no_grad()
def test_quantized_linear_and_op_use_it_for_decode_and_prefill(native):
    """ds4::fp8_linear and the experts' quantized_linear: decode rows (native product) and prefill
    rows (native tiles, several of them) against the dense product."""
    from ds4_torch.kernels import quantized

    g = torch.Generator().manual_seed(4)
    q, s = fp8_quantize(torch.randn(300, 200, generator=g), "e8m0")
    packed, s4, exact = fp4_quantize(torch.randn(96, 160, generator=g))
    dense8 = fp8_reference(q, s).double()
    tiles = quantized.NATIVE_TILE_ELEMENTS
    try:
        quantized.NATIVE_TILE_ELEMENTS = 128 * 200  # several tiles
        for n in (2, 40):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(n, 200, generator=g).to(dtype)
                assert_near(quantized.fp8_linear(x, q, s, 128, 128, "auto"), x.double() @ dense8.T, dtype)
                x = torch.randn(n, 160, generator=g).to(dtype)
                assert_near(quantized.quantized_linear(x, packed, s4, (1, 32)), x.double() @ exact.double().T, dtype)
    finally:
        quantized.NATIVE_TILE_ELEMENTS = tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_expert_groups_in_one_call_give_each_experts_product(native, dtype):
    """fp4_linear_groups (a decode step's routed experts in one call): each group's output is
    the dense product with its own expert's weight, the same bits as that expert's own
    fp4_linear call, at 1 and 2 threads, with groups of different row counts; it declines (None)
    what it does not take."""
    E, R, K = 5, 130, 96
    g = torch.Generator().manual_seed(9)
    quantized = [fp4_quantize(torch.randn(R, K, generator=g) * 3, "e8m0") for _ in range(E)]
    packed = torch.stack([q[0] for q in quantized])
    scale = torch.stack([q[1] for q in quantized])
    experts, rows = [3, 0, 4, 1], [1, 3, 16, 2]
    xs = [torch.randn(n, K, generator=g).to(dtype) for n in rows]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs = cpu_linear.fp4_linear_groups(xs, packed, scale, experts)
            assert outs is not None and [o.shape for o in outs] == [(n, R) for n in rows]
            for x, e, out in zip(xs, experts, outs):
                assert_near(out, x.double() @ quantized[e][2].double().T, dtype)
                assert torch.equal(out, cpu_linear.fp4_linear(x, packed[e], scale[e]))
    finally:
        torch.set_num_threads(before)
    assert cpu_linear.fp4_linear_groups([torch.randn(17, K).to(dtype)], packed, scale, [0]) is None  # > MAX_ROWS
    assert cpu_linear.fp4_linear_groups(xs[:1], packed, scale, [E]) is None  # no such expert
    assert cpu_linear.fp4_linear_groups([xs[0][:, :64]], packed, scale, [0]) is None  # another K
    assert cpu_linear.fp4_linear_groups([xs[0], xs[1].float().double()], packed, scale, [0, 1]) is None
    assert cpu_linear.fp4_linear_groups(xs[:1], packed, scale.float(), [0]) is None  # not e8m0 scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_a_grouped_fp8_projection_runs_in_one_call(native, dtype, monkeypatch):
    """A grouped FP8 projection (attention's wo_a: x [..., G, K], group g through its own rows)
    on a CPU: one native call for all groups, each group the dense product with its own rows and
    the same bits as fp8_linear on them, at 1 and 2 threads; more rows than the native products
    take (prefill) go group by group through the op."""
    from ds4_torch.kernels import quantized  # noqa: F401 - registers ds4::fp8_linear

    G, R, K = 4, 256, 200
    g = torch.Generator().manual_seed(6)
    q, s = fp8_quantize(torch.randn(G * R, K, generator=g) * 3, "e8m0")
    dense = fp8_reference(q, s).double().view(G, R, K)
    layer = Q.FP8BlockLinear(K, G * R, groups=G)
    layer.weight.copy_(q)
    layer.weight_scale_inv.copy_(s.float() if s.dtype != torch.float32 else s)
    calls = []
    grouped = cpu_linear.fp8_linear_groups
    monkeypatch.setattr(cpu_linear, "fp8_linear_groups", lambda *a: calls.append(a[0].shape) or grouped(*a))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for n in (1, 3):
                x = torch.randn(1, n, G, K, generator=g).to(dtype)
                got = layer(x)
                assert got.shape == (1, n, G, R)
                for j in range(G):
                    assert_near(got[..., j, :], x[..., j, :].double() @ dense[j].T, dtype)
                    assert torch.equal(got[..., j, :], cpu_linear.fp8_linear(x[..., j, :], q[j * R:(j + 1) * R],
                                                                           s[j * 2:(j + 1) * 2], 128, 128))
    finally:
        torch.set_num_threads(before)
    assert len(calls) == 4
    x = torch.randn(40, G, K, generator=g).to(dtype)
    assert grouped(x, layer.weight, layer.weight_scale_inv, 128, 128) is None  # more than MAX_ROWS rows
    want = torch.stack([x[:, j].double() @ dense[j].T for j in range(G)], dim=1)
    assert_near(layer(x), want, dtype)


@torch.no_grad()
def test_moe_decode_on_fp4_experts_reads_them_in_one_call_per_projection(native, monkeypatch):
    """ds4::moe on FP4 experts in decode (one token, several experts; a pair with no expert):
    two grouped calls, and the same bits as the per-expert loop it replaces."""
    from ds4_torch.kernels import moe as moe_module

    E, H, I = 6, 128, 64
    g = torch.Generator().manual_seed(3)
    gate_up = [fp4_quantize(torch.randn(2 * I, H, generator=g), "e8m0") for _ in range(E)]
    down = [fp4_quantize(torch.randn(H, I, generator=g), "e8m0") for _ in range(E)]
    args = [torch.stack([q[i] for q in qs]) for qs in (gate_up, down) for i in (0, 1)]
    hidden = torch.randn(1, H, generator=g).to(torch.bfloat16)
    ids, weights = torch.tensor([[4, -1, 1, 5]]), torch.rand(1, 4, generator=g)
    calls = []
    grouped = cpu_linear.fp4_linear_groups
    monkeypatch.setattr(cpu_linear, "fp4_linear_groups", lambda *a: calls.append(a[3]) or grouped(*a))
    got = moe_module.moe(hidden, ids, weights, args[0], args[2], 7.0, "torch", args[1], args[3])
    assert calls == [[1, 4, 5], [1, 4, 5]]
    monkeypatch.setattr(cpu_linear, "fp4_linear_groups", lambda *a: None)  # the loop, expert by expert
    assert torch.equal(got, moe_module.moe(hidden, ids, weights, args[0], args[2], 7.0, "torch", args[1], args[3]))


@torch.no_grad()
def test_steps_aside_for_traces_autograd_and_other_dtypes(native):
    from torch.fx.experimental.proxy_tensor import make_fx

    w = torch.randn(40, 64).to(torch.bfloat16)
    x = torch.randn(2, 64).to(torch.bfloat16)
    assert cpu_linear.bf16_linear(x, w) is not None
    assert cpu_linear.bf16_linear(x.half(), w) is None  # fp16 activations: torch's product
    assert cpu_linear.bf16_linear(torch.randn(17, 64).to(torch.bfloat16), w) is None  # prefill rows
    declined = []

    def traced(a):  # inside a trace it declines: the trace records torch ops only
        declined.append(cpu_linear.bf16_linear(a, w) is None)
        return a @ w.T

    make_fx(traced)(x)
    assert declined == [True]
    with torch.enable_grad():
        assert cpu_linear.bf16_linear(x.float().requires_grad_(), w.float().requires_grad_()) is None


def _fresh_library(monkeypatch, **env):
    monkeypatch.setattr(cpu_linear.library, "_lib", None)
    monkeypatch.setattr(cpu_linear.library, "_tried", False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("threads", [True, False], ids=["threads", "one-thread"])
@torch.no_grad()
def test_portable_build_without_avx512(native, monkeypatch, tmp_path, threads):
    """The C built with no -march (what a CPU without AVX-512 runs), with its helper threads and
    without them (a system without pthreads): the same results, within the same tolerance, at 2
    torch threads."""
    _fresh_library(monkeypatch, DS4_TORCH_CACHE=str(tmp_path))
    monkeypatch.setattr(cpu_linear, "FLAG_SETS", (["-O2", "-pthread"] if threads else ["-O2", "-DDS4_SINGLE_THREAD"],))
    assert cpu_linear.features() == {"avx512": False, "threads": threads}
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for case in (CASES[0], CASES[1], CASES[3], CASES[5], CASES[7]):
            kind, R, K, fmt, block = case
            dense, product = weights(kind, R, K, seed=R, fmt=fmt or "e8m0", block=block or 128)
            for n in ROWS:
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.randn(n, K).to(dtype)
                    assert_near(product(x), x.double() @ dense.T, dtype)
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def test_callers_on_two_threads_at_once(native):
    """Two Python threads multiplying at once at 2 torch threads (one call has the helpers, the
    other runs alone): every result is the one-thread result, bit for bit."""
    import threading

    _, product = weights("fp4", 512, 2048, seed=8)
    x = torch.randn(3, 2048, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = product(x)
        torch.set_num_threads(2)
        results = []

        def worker():
            results.extend(torch.equal(product(x), want) for _ in range(200))

        threads = [threading.Thread(target=worker) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        torch.set_num_threads(before)
    assert len(results) == 400 and all(results)


@torch.no_grad()
def test_a_forked_child_multiplies_with_threads(native):
    """A process forked after the helper threads started (a server's workers, multiprocessing's
    fork) has none of them: its products at 2 threads still finish, with the parent's bits."""
    import os
    import time

    _, product = weights("bf16", 512, 2048, seed=10)
    x = torch.randn(2, 2048, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = product(x)  # the helpers run in the parent now
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only with the parent's result, twice (the pool restarted)
            ok = all(torch.equal(product(x), want) for _ in range(2))
            os._exit(0 if ok else 1)
        deadline = time.monotonic() + 120
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung in a native product")
            time.sleep(0.05)
    finally:
        torch.set_num_threads(before)
    assert os.waitstatus_to_exitcode(status) == 0


@torch.no_grad()
def test_no_compiler_falls_back_to_torch(monkeypatch, tmp_path):
    """No compiler (CC names none, an empty cache) or DS4_TORCH_NATIVE=0: every entry point says
    None and the callers' torch paths give the product."""
    from ds4_torch.kernels import linear, quantized

    g = torch.Generator().manual_seed(5)
    q, s = fp8_quantize(torch.randn(130, 129, generator=g), "e8m0")
    packed, s4, exact = fp4_quantize(torch.randn(40, 96, generator=g))
    w = torch.randn(30, 129, generator=g).to(torch.bfloat16)
    for env in ({"CC": str(tmp_path / "no-such-compiler"), "DS4_TORCH_CACHE": str(tmp_path)},
                {"DS4_TORCH_NATIVE": "0"}):
        _fresh_library(monkeypatch, **env)
        x = torch.randn(3, 129, generator=g).to(torch.bfloat16)
        assert not cpu_linear.available() and cpu_linear.bf16_linear(x, w) is None
        assert cpu_linear.fp8_linear(x, q, s, 128, 128) is None
        assert_near(linear.fastest_linear(x, w), x.double() @ w.double().T, torch.bfloat16)
        assert_near(quantized.fp8_linear(x, q, s, 128, 128, "auto"), x.double() @ fp8_reference(q, s).double().T,
                    torch.bfloat16)
        x = torch.randn(3, 96, generator=g).to(torch.bfloat16)
        assert_near(quantized.quantized_linear(x, packed, s4, (1, 32)), x.double() @ exact.double().T, torch.bfloat16)


# --------------------------------------------------------------------------- a whole model
def small_config():
    """One CSA layer with linears over whole and partial 128x128 blocks, 8 FP4 experts."""
    from ds4_torch.config import CSA, DS4Config

    return DS4Config(vocab_size=300, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=8, head_dim=64, qk_rope_head_dim=16, q_lora_rank=128, o_groups=2,
                     o_lora_rank=128, sliding_window=8, layer_types=(CSA,), index_n_heads=8, index_head_dim=32,
                     index_topk=4, mlp_layer_types=("moe",), n_routed_experts=8, num_experts_per_tok=2, hc_mult=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """`bench quant`'s upstream-layout writer at small sizes: FP8 linears, FP4 experts, bf16 rest."""
    from ds4_torch.bench.quant import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("upstream"), small_config())


@torch.no_grad()
def test_keep_and_dequantized_bf16_models_agree(native, checkpoint, monkeypatch):
    """bf16, the shipped dtype: kept quantized (native FP8/FP4 products) and dequantized (native
    bf16 products) give the same logits within bf16's tolerance and the same greedy tokens; both
    match the torch path (DS4_TORCH_NATIVE=0) the same way."""
    from ds4_torch.generation import generate
    from ds4_torch.model import DS4ForCausalLM

    def run(mode):
        m = DS4ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, quantized=mode)
        ids = torch.randint(2, 300, (1, 12), generator=torch.Generator().manual_seed(0))
        cache = m.new_cache(1, 32)
        logits = [m(chunk, cache=cache).float() for chunk in (ids[:, :9], ids[:, 9:10], ids[:, 10:11], ids[:, 11:])]
        return torch.cat(logits, 1), list(generate(m, [5, 6, 7, 8], 12))

    keep, keep_tokens = run("keep")
    dense, dense_tokens = run("dequantize")
    # layer by layer too (random experts add little to these logits): each kept FP8 linear and
    # the FP4 experts against their dequantized twins, on the same inputs
    kept_model, dense_model = (DS4ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, quantized=mode)
                               for mode in ("keep", "dequantize"))
    dense_modules = dict(dense_model.named_modules())
    g = torch.Generator().manual_seed(1)
    checked = 0
    for name, module in kept_model.named_modules():
        if isinstance(module, Q.FP8BlockLinear):
            x = torch.randn(3, module.groups, module.in_features, generator=g).to(torch.bfloat16).squeeze(1)
            want = dense_modules[name].double()(x.double())
            assert_near(module(x), want, torch.bfloat16)
            checked += 1
        elif isinstance(module, Q.FP4Experts):
            flat = torch.randn(3, 256, generator=g).to(torch.bfloat16)
            ids, routing = torch.tensor([[0, 5], [7, 1], [5, 2]]), torch.rand(3, 2, generator=g)
            want = dense_modules[name].double()(flat.double(), ids, routing.double())
            assert_near(module(flat, ids, routing), want, torch.bfloat16)
            checked += 1
    assert checked >= 8
    _fresh_library(monkeypatch, DS4_TORCH_NATIVE="0")
    torch_keep, torch_tokens = run("keep")
    for got in (keep, dense):
        assert (got - torch_keep).abs().max() <= 2 ** -6 * torch_keep.abs().max()
    assert (keep - dense).abs().max() <= 2 ** -6 * dense.abs().max()
    assert keep_tokens == dense_tokens == torch_tokens


@torch.no_grad()
def test_model_linears_take_the_native_gemv(native, checkpoint, monkeypatch):
    """A bf16 model's plain nn.Linear layers (the head among them) multiply through the native
    GEMV in decode, and stay nn.Linear (the loader, tensor parallelism, state dicts see no change)."""
    from torch import nn

    from ds4_torch.model import DS4ForCausalLM

    m = DS4ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, quantized="dequantize")
    assert type(m.lm_head) is nn.Linear
    calls = []
    original = cpu_linear.bf16_linear
    monkeypatch.setattr(cpu_linear, "bf16_linear", lambda x, w, *a: calls.append(w.shape) or original(x, w, *a))
    cache = m.new_cache(1, 8)
    m(torch.tensor([[3, 4]]), cache=cache)
    assert tuple(m.lm_head.weight.shape) in calls
    x = torch.randn(1, 256).to(torch.bfloat16)
    assert torch.equal(m.lm_head(x), original(x, m.lm_head.weight))
    grouped = m.model.layers[0].self_attn.o_a_proj  # wo_a: a group at a time
    calls.clear()
    x = torch.randn(3, grouped.groups, grouped.in_features).to(torch.bfloat16)
    want = torch.einsum("...gi,gri->...gr", x.double(), grouped.weight.double().view(grouped.groups, -1, x.shape[-1]))
    assert_near(grouped(x), want, torch.bfloat16)
    assert len(calls) == grouped.groups


def test_read_words_sums_what_it_reads(native):
    """The roofline `bench quant` times reads every word: its sum is torch's, at 1 and 2 threads."""
    data = torch.randint(0, 2**40, (300_001,), dtype=torch.int64, generator=torch.Generator().manual_seed(6))
    want = int(data.sum()) % 2**64
    assert cpu_linear.read_words(data, 1) == want == cpu_linear.read_words(data, 2)


def test_openmp_waits_passively_unless_the_environment_or_torch_came_first():
    """ds4_torch sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP (torch's spinning threads
    would hold the cores the native products' helpers need), keeps a policy the environment
    names, changes nothing once torch is imported, and hands llama.cpp (bench quant's peer) the
    environment without its own choice."""
    import os
    import subprocess
    import sys

    probe = ("import os, ds4_torch; from ds4_torch.bench.llama_cpp import peer_environment; "
             "print(os.environ.get('OMP_WAIT_POLICY'), peer_environment().get('OMP_WAIT_POLICY'))")

    def run(code, **env):
        base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert run(probe) == ["PASSIVE", "None"]
    assert run(probe, OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", "ACTIVE"]
    assert run("import torch\n" + probe) == ["None", "None"]
