"""FP8 compressed rows (`ds4_torch.kv_format`): the quantizer against its formula; a cache storing
fp8 rows against the full-precision cache's rows put through the formula, and against the
round-trip simulation (logits bit for bit, through rollback and every way a sequence moves); and
bytes per token, cache sizes and sessions that fit (`ds4_torch.footprint`) against hand
arithmetic."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ds4_torch.cache import DS4Cache
from ds4_torch.config import CSA
from ds4_torch.footprint import kv_bytes_per_token, layer_bytes_per_token, sequence_fixed_bytes
from ds4_torch.kv_format import E4M3_MAX, FP8_GROUP, dequantize_rows, quantize_rows, round_trip_rows, row_format

DATA = Path(__file__).resolve().parents[1] / "data"


def group_scales(scales):
    return torch.exp2(scales.double() - 127)


def test_round_trip_error_is_within_half_an_e4m3_ulp_of_the_minimal_power_of_two_scale():
    g = torch.Generator().manual_seed(0)
    # six decades inside one group: normals and e4m3 subnormals both occur
    magnitudes = torch.logspace(-4, 2, 3 * FP8_GROUP)[torch.randperm(3 * FP8_GROUP, generator=g)]
    x = torch.randn(50, 3 * FP8_GROUP, generator=g) * magnitudes
    values, scales, rope = quantize_rows(x)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8 and rope.shape == (50, 0)
    s = group_scales(scales)                                    # [50, 3], each a power of two
    assert torch.equal(torch.frexp(s)[0], torch.full_like(s, 0.5))
    amax = x.double().abs().view(50, 3, FP8_GROUP).amax(-1)
    assert bool(((amax / s <= E4M3_MAX) & (amax / s > E4M3_MAX / 2)).all())  # the smallest such scale
    y = round_trip_rows(x)
    bound = torch.maximum(x.abs() / 16, s.repeat_interleave(FP8_GROUP, -1).float() / 1024)
    assert bool(((y - x).abs() <= bound).all())
    assert (y - x).abs().max() > 0
    assert torch.equal(round_trip_rows(y), y)  # rows already on the grid stay put


def test_values_on_the_grid_round_trip_exactly_and_the_e4m3_maximum_is_kept():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (8, 2 * FP8_GROUP), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    e4m3 = codes.float().nan_to_num(0.0)
    e4m3[:, 0], e4m3[:, FP8_GROUP] = E4M3_MAX, -E4M3_MAX  # the group maximum sets the scale to 2^k exactly
    k = torch.arange(-20, 20, 5).float()[:, None]
    x = e4m3 * torch.exp2(k)
    values, scales, _ = quantize_rows(x)
    assert torch.equal(scales.long() - 127, k.long().expand(8, 2))
    assert torch.equal(dequantize_rows(values, scales, torch.zeros(8, 0)), x)


def test_zeros_non_finite_values_and_extreme_magnitudes():
    zeros = torch.zeros(2, 100)
    values, scales, _ = quantize_rows(zeros)
    assert torch.equal(scales, torch.full((2, 2), 127, dtype=torch.uint8))
    assert torch.equal(round_trip_rows(zeros), zeros)
    row = torch.tensor([[1.0, float("inf"), -2.0, float("nan"), float("-inf"), 0.5] + [0.0] * 58])
    y = round_trip_rows(row)
    assert y[0, [1, 3, 4]].isnan().all()                      # e4m3fn has no infinity
    assert torch.equal(y[0, [0, 2, 5]], torch.tensor([1.0, -2.0, 0.5]))  # neighbours keep the finite scale
    huge = torch.tensor([[3e38, -1e38, 1.0] + [0.0] * 61])
    assert torch.allclose(round_trip_rows(huge)[0, :2], huge[0, :2], rtol=1 / 16)
    tiny = torch.full((1, 64), 1e-40)                          # below the e8m0 range: flushes, no NaN
    assert bool(torch.isfinite(round_trip_rows(tiny)).all())


def test_rope_channels_stay_in_the_model_dtype_and_bf16_rows_dequantize_exactly():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 7, 96, generator=g).bfloat16()
    values, scales, rope = quantize_rows(x, rope_dim=32)
    assert values.shape == (4, 7, 64) and scales.shape == (4, 7, 1) and rope.dtype == torch.bfloat16
    y = round_trip_rows(x, rope_dim=32)
    assert y.dtype == torch.bfloat16 and torch.equal(y[..., 64:], x[..., 64:])
    # the bf16 result is exact: the fp32 round trip of the same values, cast, loses nothing
    assert torch.equal(y.float(), round_trip_rows(x.float(), rope_dim=32))
    assert y.float()[..., :64].sub(x.float()[..., :64]).abs().max() > 0
    with pytest.raises(ValueError, match="rope_dim"):
        quantize_rows(x, rope_dim=97)
    with pytest.raises(ValueError, match="unknown KV row format"):
        row_format("int4")


# --------------------------------------------------------------------------- the cache option
def _first_compressed_layer(config):
    return next(i for i, k in enumerate(config.layer_types) if k == CSA)


def simulated_fp8(cache, fmt):
    """`cache` (full rows) made to store what fp8 rows hold, in its own dtype: every row goes
    through the fp8 round trip as it is written (the simulation ds4_torch had before it stored
    fp8: the reference real storage must equal bit for bit)."""
    fmt = row_format(fmt)
    for layer in cache.layers:
        for part, state in (("compressor", layer.compressor), ("indexer", layer.indexer)):
            if state is not None:
                kept, write = fmt.fp8_rope_kept(cache.config, part), state.write_rows
                state.write_rows = lambda index, rows, write=write, kept=kept: write(index, round_trip_rows(rows, kept))
    return cache


@pytest.mark.parametrize("fmt", ["fp8", "fp8-keep-rope"])
@pytest.mark.parametrize("chunk", [32, 1])
def test_a_cache_stores_exactly_the_quantized_rows_it_is_given(model, fmt, chunk):
    """The first CSA layer sees the same input whatever the cache holds (only a sliding layer
    before it), so the fp8 parts it stores must be `quantize_rows` of the full cache's rows, and
    what it reads back their round trip."""
    cfg = model.config
    i = _first_compressed_layer(cfg)
    ids = torch.randint(2, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    caches = {name: model.new_cache(2, 64, kv_rows=name) for name in ("full", fmt)}
    with torch.inference_mode():
        for cache in caches.values():
            for s in range(0, ids.shape[1], chunk):
                model(ids[:, s:s + chunk], cache)
    full, q = caches["full"].layers[i], caches[fmt].layers[i]
    rope = cfg.qk_rope_head_dim if fmt == "fp8-keep-rope" else 0
    n = 32 // full.rate
    for state, ref, kept in ((q.compressor, full.compressor, rope), (q.indexer, full.indexer, 0)):  # indexer: all fp8
        values, scales, kept_rope = quantize_rows(ref.rows[:, :n], kept)
        assert state.rows.dtype == torch.float8_e4m3fn and state.row_scales.dtype == torch.uint8
        assert torch.equal(state.rows[:, :n].view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(state.row_scales[:, :n], scales)
        assert (state.row_rope is None) == (kept == 0)
        if kept:
            assert state.row_rope.dtype == caches[fmt].dtype and torch.equal(state.row_rope[:, :n], kept_rope)
        assert torch.equal(state.visible(n), round_trip_rows(ref.rows[:, :n], kept))
        assert not torch.equal(state.visible(n), ref.rows[:, :n])


def _logits_through_thresholds(model, cache, ids, chunks):
    """Logits of `ids` [B, L] fed in prefill `chunks` (sizes), then one token at a time."""
    out, s = [], 0
    with torch.inference_mode():
        for c in chunks:
            out.append(model(ids[:, s:s + c], cache))
            s += c
        for t in range(s, ids.shape[1]):
            out.append(model(ids[:, t:t + 1], cache))
    return torch.cat(out, 1)


@pytest.mark.parametrize("fmt", ["fp8", "fp8-keep-rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_storage_gives_the_simulations_logits_bit_for_bit(model, fmt, dtype):
    """Real fp8 rows (stored as e4m3 + scale bytes, dequantized where read) against the
    simulation (rows kept in the cache dtype after the round trip), through prefill chunks and
    decode steps across the thresholds of the embedded model (window 32, CSA rate 4 with top-8,
    HCA rate 16): before and at the first CSA and HCA rows, the window filling, the indexer
    picking (more than 8 visible rows, from position 35), HCA rows at 48 and 64."""
    torch.set_num_threads(1)
    cfg = model.config
    assert (cfg.sliding_window, cfg.index_topk, cfg.compress_rates[CSA]) == (32, 8, 4)
    ids = torch.randint(2, cfg.vocab_size, (2, 68), generator=torch.Generator().manual_seed(4))
    chunks = [3, 9, 20, 14]  # to 3, 12, 32, 46; then decode 46 .. 67
    real = _logits_through_thresholds(model, model.new_cache(2, 80, dtype, kv_rows=fmt), ids, chunks)
    simulated = _logits_through_thresholds(model, simulated_fp8(model.new_cache(2, 80, dtype), fmt), ids, chunks)
    full = _logits_through_thresholds(model, model.new_cache(2, 80, dtype), ids, chunks)
    assert torch.equal(real, simulated)
    assert not torch.equal(real, full)  # the rounding is really there


@torch.no_grad()
def test_a_rolled_back_fp8_cache_equals_the_simulation_and_clears_its_scales(model):
    """A speculative verify step over fp8 rows (`Rollback`): the rejected tokens' rows cleared
    in every part (scales included, all bytes zero as allocated), and what follows equals the
    simulation taking the same steps, bit for bit."""
    from ds4_torch.cache import Rollback

    torch.set_num_threads(1)
    cfg = model.config
    ids = torch.randint(2, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    real, simulated = model.new_cache(2, 64, kv_rows="fp8-keep-rope"), simulated_fp8(model.new_cache(2, 64), "fp8-keep-rope")
    out = {}
    for name, cache in (("real", real), ("simulated", simulated)):
        model._forward(ids[:, :30], cache)
        undo = Rollback()
        model._forward(ids[:, 30:37], cache, undo=undo)  # closes CSA windows 7 (at 31) and 8 (35), HCA's 1 (31)
        undo.apply(torch.tensor([1, 6]))
        assert cache.positions.tolist() == [31, 36]
        if cache is real:  # rows past each count, rejected ones included, are all zero bytes
            for layer in real.layers:
                for state in layer.states:
                    for b, n in enumerate(cache.positions.tolist()):
                        for part in state.row_parts().values():
                            assert not part[b, n // layer.rate:-1].view(torch.uint8).any()
        out[name] = model._forward(ids[:, 37:40], cache)
    assert torch.equal(out["real"], out["simulated"])


@torch.no_grad()
@pytest.mark.parametrize("fmt", ["fp8", "fp8-keep-rope"])
def test_an_fp8_sequence_moves_with_its_format_and_goes_on_exactly(model, fmt):
    """export/import, copy_sequence, a checkpoint's restore and branch on fp8 rows: the state
    carries the stored parts (e4m3 values, scale bytes, kept RoPE channels, as `sequence_spec`
    lists them), and every way of moving it continues with the logits the source gives."""
    from ds4_torch.cache import sequence_spec

    torch.set_num_threads(1)
    cfg = model.config
    ids = torch.randint(2, cfg.vocab_size, (1, 50), generator=torch.Generator().manual_seed(6))
    src = model.new_cache(2, 64, kv_rows=fmt)
    model(ids[:, :24], src.slot(0))
    ckpt = src.take_checkpoint(0)
    model(ids[:, 24:45], src.slot(0))
    state = src.export_sequence(0)
    assert [(k, t.dtype, tuple(t.shape)) for k, t in state.items()] == sequence_spec(cfg, 45, src.dtype, fmt)
    i = _first_compressed_layer(cfg)
    assert state[f"layers.{i}.compressor.rows"].dtype == torch.float8_e4m3fn
    assert state[f"layers.{i}.compressor.row_scales"].shape == (45 // 4, 1)
    assert (f"layers.{i}.compressor.row_rope" in state) == (fmt == "fp8-keep-rope")
    assert f"layers.{i}.indexer.row_rope" not in state

    def go_on(cache):
        return model(ids[:, 45:50], cache)

    imported = model.new_cache(1, 64, kv_rows=fmt)
    model(ids[:, 10:60], imported)  # a slot holding more rows than the state: they must not survive
    imported.import_sequence(0, {k: v.clone() for k, v in state.items()})
    copied = model.new_cache(2, 64, kv_rows=fmt)
    copied.copy_sequence(1, 0, source=src)
    want = go_on(src.slot(0))
    assert torch.equal(go_on(imported), want) and torch.equal(go_on(copied.slot(1)), want)

    # back to the checkpoint at 24: in place, and branched into another cache, then on to 45
    branched = model.new_cache(1, 64, kv_rows=fmt)
    branched.branch_from_checkpoint(0, 0, ckpt, source=src)
    src.restore_checkpoint(0, ckpt)
    for cache in (src.slot(0), branched):
        for layer in cache.layers:  # rows past 24 // m: zero bytes in every part
            for s in layer.states:
                assert not any(p[0, 24 // layer.rate:].view(torch.uint8).any() for p in s.row_parts().values())
        model(ids[:, 24:45], cache)
        assert torch.equal(go_on(cache), want)


@pytest.mark.parametrize("src_fmt,dst_fmt", [("full", "fp8"), ("fp8", "full"), ("fp8", "fp8-keep-rope"),
                                             ("fp8-keep-rope", "fp8")])
def test_a_state_of_another_row_format_is_refused_and_the_cache_left_as_it_was(model, src_fmt, dst_fmt):
    ids = torch.randint(2, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(8))
    src, dst = model.new_cache(1, 32, kv_rows=src_fmt), model.new_cache(1, 32, kv_rows=dst_fmt)
    with torch.inference_mode():
        model(ids, src)
        model(ids[:, :9], dst)
    before = [t.clone() for t in dst.tensors()]
    with pytest.raises(ValueError, match=f"stored as '{src_fmt}', this cache's as '{dst_fmt}'"):
        dst.import_sequence(0, src.export_sequence(0))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, dst.tensors()))


def test_copying_between_caches_of_different_row_formats_is_refused(model):
    a, b = model.new_cache(1, 16), model.new_cache(1, 16, kv_rows="fp8")
    with pytest.raises(ValueError, match="kv_rows"):
        b.copy_sequence(0, 0, source=a)


def test_fp8_rows_meet_the_issue_targets_on_held_out_text(capsys):
    """#36: mean |NLL difference| <= 0.02 nats per token and top-1 agreement >= 97% against the
    full-precision cache (prompt logprobs, 32-token chunks) on held-out text: what
    `python examples/measure_kv_fp8.py` measures as it is run in a fresh clone, whose default text
    is the held-out slice shipped in tests/data (a clone has no ../shared)."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("measure_kv_fp8", root / "examples" / "measure_kv_fp8.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main([])
    assert "tests/data/tinyshakespeare_held_out.txt" in capsys.readouterr().err
    assert result["segments"] == 1 and result["tokens"] == 1023  # the slice's 1,061 tokens hold one 1,024
    for fmt in ("fp8", "fp8-keep-rope"):
        diff, agree = result[fmt]["mean_abs_nll_diff"], result[fmt]["top1_agreement"]
        assert 0 < diff <= 0.02 and agree >= 0.97, (fmt, diff, agree)
        assert result[fmt]["cache_bytes_per_token"] < result["full_cache_bytes_per_token"]


# --------------------------------------------------------------------------- bytes per token
def test_bytes_per_token_at_v4_flash_shapes_against_hand_arithmetic():
    from ds4_torch.config import v4_flash_config

    cfg = v4_flash_config()
    # 21 CSA layers (rate 4: a 512-channel row and a 128-channel indexer row per 4 tokens) and
    # 20 HCA layers (rate 128: a 512-channel row per 128 tokens); the 2 sliding layers hold none.
    bf16 = 21 * (512 + 128) * 2 / 4 + 20 * 512 * 2 / 128
    assert kv_bytes_per_token(cfg, "full", torch.bfloat16) == bf16 == 6880
    # fp8: a byte per channel and a scale byte per 64 channels
    fp8 = 21 * ((512 + 8) + (128 + 2)) / 4 + 20 * (512 + 8) / 128
    assert kv_bytes_per_token(cfg, "fp8", torch.bfloat16) == fp8
    # fp8-keep-rope: the 64 RoPE channels of an attention row in bf16 (448 + 7 + 128 B); indexer all fp8
    rope = 21 * ((448 + 7 + 128) + (128 + 2)) / 4 + 20 * (448 + 7 + 128) / 128
    assert kv_bytes_per_token(cfg, "fp8-keep-rope", torch.bfloat16) == rope
    assert fp8 / bf16 <= 0.55 < rope / bf16  # the issue's target is met with the RoPE channels in fp8 too
    assert sum(layer_bytes_per_token(cfg, "fp8", torch.bfloat16)) == fp8
    # the window ring and the open windows: a sequence's fixed part, in the model dtype
    # (elements; 2 B each): the ring; per CSA layer open kv/gate [4, 2 x 512] and overlap kv/gate
    # [4, 512], the same for the indexer at 128; per HCA layer open kv/gate [128, 512]; the position.
    ring = 43 * 128 * 512
    frontier = 21 * (2 * 4 * 1024 + 2 * 4 * 512 + 2 * 4 * 256 + 2 * 4 * 128) + 20 * (2 * 128 * 512)
    assert sequence_fixed_bytes(cfg, torch.bfloat16) == 2 * (ring + frontier) + 8


def test_bytes_per_token_of_the_embedded_model_and_the_static_cache(model):
    cfg = model.config  # 2 CSA (rate 4) + 1 HCA (rate 16) layers, head 32 (16 RoPE), indexer 32
    fp32 = 2 * (32 + 32) * 4 / 4 + 32 * 4 / 16
    assert kv_bytes_per_token(cfg, "full", torch.float32) == fp32
    fp8 = 2 * (33 + 33) / 4 + 33 / 16
    rope = 2 * ((16 + 1 + 16 * 4) + 33) / 4 + (16 + 1 + 16 * 4) / 16
    assert kv_bytes_per_token(cfg, "fp8", torch.float32) == fp8
    assert kv_bytes_per_token(cfg, "fp8-keep-rope", torch.float32) == rope
    assert rope / fp32 <= 0.5 and fp8 / fp32 <= 0.5
    # a static cache of C tokens = the fixed part + the rows of C tokens + a scratch row per layer
    C = 4096
    scratch = 2 * (32 + 32) * 4 + 32 * 4
    assert DS4Cache(cfg, 1, C).nbytes == sequence_fixed_bytes(cfg, torch.float32) + fp32 * C + scratch
    # and in fp8, stored for real: a row's bytes as above
    for fmt, per_token, scratch in (("fp8", fp8, 2 * (33 + 33) + 33),
                                    ("fp8-keep-rope", rope, 2 * ((16 + 1 + 16 * 4) + 33) + (16 + 1 + 16 * 4))):
        nbytes = DS4Cache(cfg, 1, C, kv_rows=fmt).nbytes
        assert nbytes == sequence_fixed_bytes(cfg, torch.float32) + per_token * C + scratch
        assert nbytes <= 0.5 * DS4Cache(cfg, 1, C).nbytes


def test_static_sizes_are_what_a_cache_allocates():
    from ds4_torch.config import v4_flash_config
    from ds4_torch.default_model import default_config
    from ds4_torch.footprint import static_sequence_bytes

    for cfg, dtype in ((v4_flash_config(), torch.bfloat16), (default_config(), torch.float32)):
        for ctx in (1000, 40 * 1024):
            for fmt in ("full", "fp8", "fp8-keep-rope"):
                cache = DS4Cache(cfg, 1, ctx, dtype, "meta", kv_rows=fmt)
                assert static_sequence_bytes(cfg, ctx, fmt, dtype) == cache.nbytes


def test_a_paged_pool_holds_fp8_rows_at_their_bytes_per_token():
    """The pool of a paged cache (every block's rows plus a scratch row per compressor and
    indexer), by hand: a small config (2 CSA layers of rate 4, head 16 with 8 RoPE channels,
    indexer 8; 1 HCA layer of rate 8; no MTP layer) in fp32."""
    from ds4_torch.config import DS4Config
    from ds4_torch.paged import PagedDS4Cache, block_nbytes
    from test_paged import SMALL

    cfg = DS4Config.from_dict(SMALL)
    assert cfg.num_nextn_predict_layers == 0
    # bytes of a CSA row, its indexer row and an HCA row: fp32, or a byte per fp8 channel, a
    # scale byte and the 8 RoPE channels in fp32
    rows = {"full": (64, 32, 64), "fp8": (16 + 1, 8 + 1, 16 + 1), "fp8-keep-rope": (8 + 1 + 32, 8 + 1, 8 + 1 + 32)}
    csa, idx, hca = ({f: r[k] for f, r in rows.items()} for k in range(3))
    per_token = {f: 2 * (csa[f] + idx[f]) / 4 + hca[f] / 8 for f in csa}  # bytes of compressed rows per token
    assert per_token == {f: kv_bytes_per_token(cfg, f, torch.float32) for f in csa}
    blocks, bt = 12, 8
    fixed = 2 * sequence_fixed_bytes(cfg, torch.float32)  # two sequences' rings, open windows, positions
    for fmt in csa:
        cache = PagedDS4Cache(cfg, 2, 48, kv_rows=fmt, num_blocks=blocks, block_tokens=bt)
        scratch = 2 * (csa[fmt] + idx[fmt]) + hca[fmt]
        slot_maps = 8 * 2 * ((48 // 4 + 1) + (48 // 8 + 1))  # int64 [B, C+1] per rate
        assert cache.nbytes == fixed + blocks * bt * per_token[fmt] + scratch + slot_maps, fmt
        assert cache.block_nbytes == bt * per_token[fmt] == block_nbytes(cfg, torch.float32, bt, fmt)


def test_v4_flash_session_table_against_hand_arithmetic():
    from ds4_torch.config import v4_flash_config
    from ds4_torch.footprint import session_table

    cfg, GiB = v4_flash_config(), 2**30
    budget = 67 * GiB
    fixed = 2 * (43 * 128 * 512 + 21 * (2 * 4 * 1024 + 2 * 4 * 512 + 2 * 4 * 256 + 2 * 4 * 128)
                 + 20 * (2 * 128 * 512)) + 8
    per_token = {"full": 6880, "fp8": 21 * (520 + 130) / 4 + 20 * 520 / 128}
    row_pair = {"full": ((512 + 128) * 2, 512 * 2), "fp8": (520 + 130, 520)}  # CSA, HCA bytes per row
    table = session_table(cfg, torch.bfloat16, budget)
    assert [r["tokens"] for r in table] == [40960, 131072, 1048576]
    for row in table:
        n = row["tokens"]
        for fmt in ("full", "fp8"):
            csa, hca = row_pair[fmt]
            static_max = fixed + (2**20 // 4 + 1) * 21 * csa + (2**20 // 128 + 1) * 20 * hca
            static = fixed + (n // 4 + 1) * 21 * csa + (n // 128 + 1) * 20 * hca
            paged = fixed + n * per_token[fmt]  # n is a whole number of 256-token blocks
            prefix = 20480 * per_token[fmt]
            want = {"static_max": int(budget // static_max), "static": int(budget // static),
                    "paged": int(budget // paged), "session_bytes": paged,
                    "paged_shared": int((budget - prefix) // (paged - prefix))}
            assert row[fmt] == want, (n, fmt)
    assert table[0]["fp8"]["paged_shared"] > 3 * table[0]["full"]["paged"]  # 40K: 245 bf16 -> 865 fp8 + sharing


def test_info_prints_bytes_per_token_for_each_row_format(capsys):
    from ds4_torch.cli import main
    from ds4_torch.default_model import default_config

    assert main(["info", "--dtype", "float32", "--ctx", "4096", "--memory-gb", "1", "--kv-table"]) == 0
    out = capsys.readouterr().out
    cfg = default_config()
    for name, label in (("full", "float32"), ("fp8", "fp8 (every channel)"), ("fp8-keep-rope", "fp8, RoPE channels")):
        b = kv_bytes_per_token(cfg, name, torch.float32)
        static = DS4Cache(cfg, 1, 4096, kv_rows=name).nbytes / 4096  # what a cache really allocates
        line = next(l for l in out.splitlines() if l.strip().startswith(label))
        assert f"{b:,.2f}" in line and f"static cache: {static:,.2f}" in line
    assert "| 40,960 |" in out and "| 131,072 |" in out and "1,048,576" not in out  # past the model's maximum
    assert main(["info", "--kv-table"]) == 2  # needs --memory-gb
