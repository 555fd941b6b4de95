"""Checkpoints: rewind a sequence in place, branch another slot from it, and continue exactly as a
cold prefill of the same tokens would (fp32 logits within 1e-5, identical greedy continuations).

Every case takes a checkpoint at p while feeding a first sequence A, runs A on past p, then makes
a second sequence B = A[:d] + new tokens (d >= p: the divergence) from the checkpoint by feeding
B[p:]. The reference is a fresh cache fed all of B at once. The positions sit on the boundaries
that matter: inside the first window, right before, at and right after a CSA and an HCA window
closes, at the window fill, at a checkpoint exactly, and K-1 tokens after one."""
from __future__ import annotations

import io

import pytest
import torch

from ds4_torch import DS4ForCausalLM
from ds4_torch.cache import checkpoint_nbytes
from ds4_torch.config import CSA, HCA
from oracle import make_oracle
from test_cache import expected_export_bytes, with_edits

CTX = 160
TAIL = 10      # tokens B has past its divergence
RUN_ON = 37    # tokens A runs on past the divergence before it is rewound
GREEDY = 6

# The embedded model: window 32, CSA rate 4, HCA rate 16. (p, d): checkpoint, divergence.
DEFAULT_CASES = [
    (0, 0),     # a checkpoint of the empty sequence
    (5, 9),     # inside the first window, no compressed row yet
    (31, 33),   # the window fills at 32
    (43, 43),   # right before a CSA window closes (44), at the checkpoint exactly
    (45, 45),   # right after it
    (47, 47),   # right before a CSA and an HCA window close (48)
    (48, 48),   # exactly as they close
    (49, 52),   # right after
    (64, 79),   # K-1 tokens after a checkpoint (K = 16), HCA closes at 80 right after
]
# The random oracle config: window 6, CSA rate 4, HCA rate 8, 8 indexer heads.
SMALL_CASES = [(3, 3), (7, 7), (8, 8), (9, 11), (16, 23)]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    _, path = make_oracle(tmp_path_factory.mktemp("checkpoints"), seed=11)
    return DS4ForCausalLM.from_pretrained(path)


def sequences(model, p, d, seed):
    """A (runs RUN_ON tokens past d) and B (A[:d], then TAIL tokens that differ from A's at d)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    a = torch.randint(2, vocab, (d + RUN_ON,), generator=g).tolist()
    tail = torch.randint(2, vocab, (TAIL,), generator=g).tolist()
    if tail[0] == a[d]:
        tail[0] = 2 + (tail[0] - 1) % (vocab - 2)
    return a, a[:d] + tail


@torch.no_grad()
def feed(model, cache, index, tokens, chunk=16):
    """Feed `tokens` to sequence `index` in chunks; the last token's logits [V] (None if none)."""
    logits = None
    for a in range(0, len(tokens), chunk):
        logits = model(torch.tensor([tokens[a:a + chunk]]), cache=cache.slot(index))[0, -1]
    return logits


@torch.no_grad()
def greedy(model, cache, index, logits, n=GREEDY):
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model(torch.tensor([[out[-1]]]), cache=cache.slot(index))[0, -1]
    return out


@torch.no_grad()
def cold(model, tokens, split=None, chunk=16):
    """The reference: a fresh cache fed `tokens` (at once, or in chunks of `chunk` up to `split`
    and of 16 from there, as the checkpointed path feeds them); (logits, greedy continuation)."""
    cache = model.new_cache(1, CTX)
    if split is None:
        logits = model(torch.tensor([tokens]), cache=cache)[0, -1]
    else:
        logits = feed(model, cache, 0, tokens[:split], chunk)
        logits = feed(model, cache, 0, tokens[split:]) if split < len(tokens) else logits
    return logits, greedy(model, cache, 0, logits)


def assert_continues_like_cold(model, cache, index, logits, tokens, split, chunk=16):
    """Logits within 1e-5 of a cold run fed in the same pieces (on CPU they are bit for bit the
    same), and within 2e-6 of the largest logit of one fed at once (where chunking alone moves
    them: up to 1.3e-5 absolute, 9e-7 relative, in these cases); greedy tokens equal to both."""
    want, want_tokens = cold(model, tokens, split, chunk)
    once, once_tokens = cold(model, tokens)
    assert (logits - want).abs().max() <= 1e-5
    assert (logits - once).abs().max() <= 2e-6 * once.abs().max()
    assert greedy(model, cache, index, logits) == want_tokens == once_tokens


def checkpointed_run(model, cache, index, a, p, chunk=16):
    """Feed A to sequence `index` in chunks of `chunk`, taking a checkpoint at p (with the next
    token's logits)."""
    logits = feed(model, cache, index, a[:p], chunk)
    checkpoint = cache.take_checkpoint(index, logits)
    feed(model, cache, index, a[p:], chunk)
    return checkpoint


def rewind_case(model, p, d, chunk=16):
    a, b = sequences(model, p, d, seed=1000 * p + d)
    cache = model.new_cache(1, CTX)
    checkpoint = checkpointed_run(model, cache, 0, a, p, chunk)
    cache.restore_checkpoint(0, checkpoint)
    assert cache.positions.tolist() == [p]
    for layer in cache.layers:  # A's later rows are gone: a slot holds no row past its count
        assert all(not s.rows[0, p // layer.rate:].any() for s in layer.states)
    assert_continues_like_cold(model, cache, 0, feed(model, cache, 0, b[p:]), b, p, chunk)


@pytest.mark.parametrize("p,d", DEFAULT_CASES)
def test_rewind_in_place_equals_a_cold_prefill(model, p, d):
    rewind_case(model, p, d)


@pytest.mark.parametrize("p,d", SMALL_CASES)
def test_rewind_in_place_equals_a_cold_prefill_small(small, p, d):
    rewind_case(small, p, d)


@pytest.mark.parametrize("which,p,d", [("small", 9, 11), ("small", 16, 23), ("model", 47, 50), ("model", 64, 64)])
def test_rewind_of_a_sequence_decoded_token_by_token(request, which, p, d):
    """Checkpoints taken between decode steps (one token per forward: open windows hold stale
    slots from earlier windows) rewind as exactly."""
    rewind_case(request.getfixturevalue(which), p, d, chunk=1)


@pytest.mark.parametrize("p,d", [(9, 12), (48, 48), (64, 79)])
@torch.no_grad()
def test_branch_in_a_batch_leaves_the_others_untouched(model, p, d):
    """Slot 0 holds A (checkpointed at p), slot 2 an unrelated sequence; slot 1 (which held a
    longer sequence before) branches from slot 0 and feeds B. Slots 0 and 2 are bit for bit as
    before; then all three decode together, each like its own cold run."""
    a, b = sequences(model, p, d, seed=7 * p + d)
    other = sequences(model, 3, 50, seed=5)[0]
    cache = model.new_cache(3, CTX)
    feed(model, cache, 1, other + other[:20])
    checkpoint = checkpointed_run(model, cache, 0, a, p)
    feed(model, cache, 2, other)
    before = [[t[i].clone() for t in cache.tensors()] for i in (0, 2)]
    cache.branch_from_checkpoint(1, 0, checkpoint)
    logits_b = feed(model, cache, 1, b[p:])
    for i, saved in zip((0, 2), before):
        assert all(torch.equal(t[i], s) for t, s in zip(cache.tensors(), saved))
    assert cache.positions.tolist() == [len(a), len(b), len(other)]

    logits = torch.stack([model(torch.tensor([a]))[0, -1], logits_b, model(torch.tensor([other]))[0, -1]])
    tokens = [[], [], []]
    for _ in range(GREEDY):
        ids = logits.argmax(-1)
        for row, t in zip(tokens, ids.tolist()):
            row.append(t)
        logits = model(ids.view(3, 1), cache=cache)[:, -1]
    assert tokens == [cold(model, s)[1] for s in (a, b, other)]


@pytest.mark.parametrize("p", [0, 13, 48])
@torch.no_grad()
def test_a_checkpoint_at_the_prompt_end_needs_no_recompute(model, p):
    """Re-sending A[:p]: the checkpoint's logits are the cold run's, and the rewound sequence
    continues like it."""
    a, _ = sequences(model, p, p, seed=p)
    cache = model.new_cache(1, CTX)
    checkpoint = checkpointed_run(model, cache, 0, a, p)
    cache.restore_checkpoint(0, checkpoint)
    if p == 0:
        assert "logits" not in checkpoint  # nothing was fed: there are no next-token logits
        return
    assert_continues_like_cold(model, cache, 0, checkpoint["logits"], a[:p], p)


@torch.no_grad()
def test_after_an_export_import_round_trip(model, tmp_path):
    """A sequence and its checkpoint go through bytes (torch.save) into another cache: branching
    from them there equals the cold run."""
    p, d = 40, 46
    a, b = sequences(model, p, d, seed=3)
    cache = model.new_cache(2, CTX)
    checkpoint = checkpointed_run(model, cache, 1, a, p)
    buf = io.BytesIO()
    torch.save({"sequence": cache.export_sequence(1), "checkpoint": checkpoint}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    other = model.new_cache(3, CTX)
    other.import_sequence(2, saved["sequence"])
    imported = other.import_checkpoint(saved["checkpoint"])
    assert imported.keys() == checkpoint.keys() and all(torch.equal(imported[k], t) for k, t in checkpoint.items())
    other.branch_from_checkpoint(0, 2, imported)
    assert_continues_like_cold(model, other, 0, feed(model, other, 0, b[p:]), b, p)
    other.restore_checkpoint(2, saved["checkpoint"])  # and in place, in the imported slot
    assert_continues_like_cold(model, other, 2, feed(model, other, 2, b[p:]), b, p)


@torch.no_grad()
def test_a_checkpoint_is_fixed_size_and_canonical(model):
    """Its bytes follow the layout alone (the export's size at 0 tokens, plus the row counts):
    the same at every position, whatever the max_context; two caches in the same state give the
    same tensors (stale open-window slots zeroed)."""
    cfg = model.config
    a, _ = sequences(model, 0, 90, seed=9)
    for ctx, n in ((64, 5), (CTX, 50), (4000, 90)):
        cache = model.new_cache(1, ctx)
        feed(model, cache, 0, a[:n])
        checkpoint = cache.take_checkpoint(0)
        size = sum(t.numel() * t.element_size() for t in checkpoint.values())
        assert size == expected_export_bytes(cfg, 0, 4) + 8 * cfg.num_hidden_layers == cache.checkpoint_nbytes()
        assert checkpoint["row_counts"].tolist() == [n // cfg.compress_rate(i) if cfg.compress_rate(i) else 0
                                                     for i in range(cfg.num_hidden_layers)]
    one_by_one = model.new_cache(1, CTX)
    for t in a[:50]:
        feed(model, one_by_one, 0, [t])
    at_once = model.new_cache(1, CTX)
    feed(model, at_once, 0, a[:50], chunk=50)
    x, y = one_by_one.take_checkpoint(0), at_once.take_checkpoint(0)
    assert x.keys() == y.keys() and all((x[k].double() - y[k].double()).abs().max() <= 1e-5 for k in x)
    assert checkpoint_nbytes(cfg, torch.bfloat16, torch.float32) == \
        expected_export_bytes(cfg, 0, 2) + 8 * cfg.num_hidden_layers + 4 * cfg.vocab_size


FLASH_BF16_BYTES = (43 * 128 * 512 * 2                                              # the ring
                    + 20 * (2 * 128 * 512) * 2                                       # HCA open windows
                    + 21 * (2 * 4 * 1024 + 2 * 4 * 512 + 2 * 4 * 256 + 2 * 4 * 128) * 2  # CSA frontier
                    + 8 + 8 * 43)                                                    # position, row counts


def test_v4_flash_checkpoint_bytes():
    """43 layers (2 sliding, 21 CSA, 20 HCA), window 128, head_dim 512, indexer 128, bf16: the
    ring (43 x 128 x 512 x 2 B) plus the open windows and overlaps, by hand."""
    from ds4_torch.bench.checkpoint import flash_config

    cfg = flash_config()
    assert (cfg.layer_types.count(CSA), cfg.layer_types.count(HCA)) == (21, 20)
    assert (cfg.sliding_window, cfg.head_dim, cfg.index_head_dim, cfg.compress_rates) == \
        (128, 512, 128, {CSA: 4, HCA: 128})
    assert checkpoint_nbytes(cfg, torch.bfloat16) == FLASH_BF16_BYTES == 11_524_448


def test_bench_checkpoint(tmp_path, capsys):
    """`ds4-torch bench checkpoint` runs at V4-Flash's layout and reports the bytes by hand."""
    import csv

    from ds4_torch.cli import main

    table = tmp_path / "checkpoint.csv"
    assert main(["bench", "checkpoint", "--contexts", "300", "--repeats", "1", "--csv", str(table)]) == 0
    (row,) = list(csv.DictReader(table.open()))
    assert int(row["checkpoint_bytes"]) == FLASH_BF16_BYTES and int(row["checkpoint_at"]) == 300 - 128
    assert all(float(row[k]) > 0 for k in row if k.endswith("_ms"))
    assert "11,524,448" in capsys.readouterr().out


@torch.no_grad()
def test_malformed_checkpoints_are_refused_and_write_nothing(model):
    """Layout (names, dtypes, shapes, position, row counts): refused by every entry point; values
    (finite, stale slots, overlap): by import_checkpoint and check_checkpoint. Nothing written."""
    a, _ = sequences(model, 0, 60, seed=2)
    cache = model.new_cache(2, 64)
    feed(model, cache, 0, a[:30])
    good = cache.take_checkpoint(0, torch.zeros(model.config.vocab_size))
    feed(model, cache, 0, a[30:40])
    before = [t.clone() for t in cache.tensors()]

    def changed(**edits):
        return with_edits(good, **edits)

    def written(name, index, value):
        t = good[name].clone()
        t[index] = value
        return t

    cases = [
        (changed(**{"layers.0.window": None}), r"missing \['layers\.0\.window'\]"),
        (changed(**{"layers.1.compressor.rows": good["layers.0.window"]}), "unexpected"),
        (changed(**{"layers.0.window": good["layers.0.window"].double()}), "layers.0.window"),
        (changed(**{"layers.2.compressor.open_kv": good["layers.2.compressor.open_kv"][:-1]}), "layers.2.compressor"),
        (changed(logits=torch.zeros(3)), "logits"),
        (changed(logits=torch.zeros(model.config.vocab_size, dtype=torch.long)), "logits"),
        (changed(position=torch.tensor(32)), "row_counts"),
        (changed(position=torch.tensor(65)), "max_context"),
        (changed(position=torch.tensor(30, dtype=torch.int32)), "position"),
        (changed(row_counts=good["row_counts"] + 1), "row_counts"),
        ([1, 2], "mapping"),
    ]
    # values: checked where a checkpoint comes from elsewhere (a restore trusts its own, as an
    # import_sequence trusts a state's values)
    value_cases = [
        (changed(**{"layers.1.indexer.open_kv": written("layers.1.indexer.open_kv", 3, 1.0)}), "slots past position"),
        (changed(**{"layers.0.window": written("layers.0.window", 0, float("nan"))}), "not finite"),
        (changed(**{"layers.1.compressor.prev_gate": written("layers.1.compressor.prev_gate", 0, float("-inf"))}),
         "overlap"),
    ]
    layout_checks = (lambda c: cache.restore_checkpoint(0, c), lambda c: cache.branch_from_checkpoint(1, 0, c))
    for checkpoint, message, acts in [(c, m, layout_checks) for c, m in cases] + [(c, m, ()) for c, m in value_cases]:
        for act in (cache.import_checkpoint, cache.check_checkpoint) + acts:
            with pytest.raises(ValueError, match=message):
                act(checkpoint)
            assert all(torch.equal(x, y) for x, y in zip(cache.tensors(), before))

    early = model.new_cache(1, 64)
    feed(model, early, 0, a[:12])
    with pytest.raises(ValueError, match="holds only 12 tokens"):
        early.restore_checkpoint(0, good)
    with pytest.raises(ValueError, match="holds only 12 tokens"):
        cache.branch_from_checkpoint(1, 0, good, source=early)
    empty = model.new_cache(1, 64)  # 0 tokens: a checkpoint of the empty sequence has no closed window
    bad = empty.take_checkpoint(0)
    bad["layers.1.compressor.prev_gate"] = torch.zeros_like(bad["layers.1.compressor.prev_gate"])
    with pytest.raises(ValueError, match="overlap"):
        empty.import_checkpoint(bad)
    from ds4_torch.cache import DS4Cache
    other = DS4Cache(model.config.replace(sliding_window=5), 1, 64)
    with pytest.raises(ValueError, match="same config"):
        other.branch_from_checkpoint(0, 0, good, source=cache)
    with pytest.raises(ValueError, match="window"):
        other.restore_checkpoint(0, good)
    cache.invalidate([0])
    with pytest.raises(RuntimeError, match="invalidated"):
        cache.take_checkpoint(0)
    with pytest.raises(RuntimeError, match="invalidated"):
        cache.branch_from_checkpoint(1, 0, good)


def test_the_branch_conversation_example(capsys):
    """examples/branch_conversation.py runs, reuses the system prompt, and agrees with cold runs."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "branch_conversation.py"
    spec = importlib.util.spec_from_file_location("branch_conversation", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main()
    assert 0 < result["reused"] < result["prompt_b"]
    assert result["regenerated_same"] and result["reply_same"]
    assert result["same_pieces"] <= 1e-5 and result["at_once"] <= 2e-6 * result["logit_scale"]
    assert "same reply: True" in capsys.readouterr().out


@torch.no_grad()
def test_graph_decode_reads_a_restored_and_a_branched_slot(model):
    """Decode steps replayed from one captured graph (the capture emulator off CUDA: Python values
    frozen as a CUDA graph freezes them) before and after slot 0 is rewound and slot 1 branched
    from it: the graph reads the new state (no tensor was reallocated, nothing recaptured) and
    both continue like cold runs."""
    from ds4_torch.decode import make_decoder

    p, d = 40, 45
    a, b = sequences(model, p, d, seed=17)
    c = a[:p] + sequences(model, 0, 6, seed=18)[0][:9]
    cache = model.new_cache(2, CTX)
    checkpoint = checkpointed_run(model, cache, 0, a, p)
    feed(model, cache, 1, a[:p + 3])
    decoder = make_decoder(model, cache, "graph")
    assert decoder.mode == "graph"
    decoder.step(torch.tensor([a[-1], a[p + 3]]))  # captured here, at other positions
    cache.restore_checkpoint(0, checkpoint)
    cache.branch_from_checkpoint(1, 0, checkpoint)
    logits = torch.stack([feed(model, cache, 0, b[p:]), feed(model, cache, 1, c[p:])])
    tokens = [[], []]
    for _ in range(GREEDY):
        ids = logits.argmax(-1)
        for row, t in zip(tokens, ids.tolist()):
            row.append(t)
        logits = decoder.step(ids)
    assert list(decoder.graphs) == [2] and decoder.eager_fallbacks == 0
    assert tokens == [cold(model, b)[1], cold(model, c)[1]]
