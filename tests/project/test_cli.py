"""The ds4-torch command, run in-process through main() (plus one real subprocess)."""
import csv
import json
import subprocess
import sys

import pytest
import torch

from ds4_torch import __version__
from ds4_torch.cli import main
from ds4_torch.default_model import build_default_model, default_config, default_tokenizer
from ds4_torch.model import DS4ForCausalLM
from ds4_torch.tokenizer import load_tokenizer

from helpers import write_bpe


@pytest.fixture(scope="module")
def default_model():
    return build_default_model()


def greedy_stateless(model, ids, n):
    """Reference continuation: the whole sequence through the cache-free forward each step."""
    ids = list(ids)
    out = []
    with torch.inference_mode():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
    return out


def run_cli(capsys, *argv):
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def assert_one_line_error(rc, err, *fragments):
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4-torch: error:"), err
    assert "Traceback" not in err
    for f in fragments:
        assert f in lines[0]


# --------------------------------------------------------------------------- generate
def until_eos(tokens, eos):
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def test_generate_default_model_matches_stateless_greedy(capsys, default_model):
    prompt = "To be, or not to be"
    tok = default_tokenizer()
    # 40 tokens cross the window (32) and several compressed rows of every rate.
    rc, out, err = run_cli(capsys, "generate", "-p", prompt, "-n", "40")
    assert rc == 0, err
    expected = until_eos(greedy_stateless(default_model, tok.encode(prompt), 40), tok.eos_token_id)
    assert out == tok.decode(expected) + "\n"
    assert f"{len(expected)} new tokens" in err


def test_generate_quantized_keep_on_an_unquantized_model_changes_nothing(capsys):
    rc, plain, err = run_cli(capsys, "generate", "-p", "To be", "-n", "12")
    assert rc == 0, err
    rc, kept, err = run_cli(capsys, "generate", "-p", "To be", "-n", "12", "--quantized", "keep")
    assert rc == 0, err
    assert kept == plain
    rc, _, err = run_cli(capsys, "bench", "model", "--quantized", "keep")
    assert_one_line_error(rc, err, "--quantized keep")


def test_generate_chat_uses_the_chat_format(capsys, default_model):
    rc, out, _ = run_cli(capsys, "generate", "--chat", "-p", "Hi", "-n", "5")
    assert rc == 0
    tok = default_tokenizer()
    chat = tok.encode("<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>")  # DeepSeek-V4, chat mode
    assert chat == tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert out == tok.decode(until_eos(greedy_stateless(default_model, chat, 5), tok.eos_token_id)) + "\n"


def test_generate_sampling_is_seeded(capsys):
    args = ("generate", "-p", "abc", "-n", "24", "--temperature", "1.5", "--top-k", "50", "--seed")
    outs = [run_cli(capsys, *args, seed)[1] for seed in ("7", "7", "8")]
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]


def test_generate_bad_sampling_setting(capsys):
    rc, _, err = run_cli(capsys, "generate", "-p", "abc", "--top-p", "0")
    assert_one_line_error(rc, err, "top_p")


def test_generate_in_bfloat16_follows_a_bfloat16_model(capsys):
    """--dtype reaches the model: the text is the greedy continuation of the model loaded in bf16."""
    prompt, tok = "To be, or not to be", default_tokenizer()
    rc, out, err = run_cli(capsys, "generate", "-p", prompt, "-n", "12", "--device", "cpu", "--dtype", "bfloat16")
    assert rc == 0, err
    bf16 = build_default_model(dtype=torch.bfloat16)
    assert out == tok.decode(until_eos(greedy_stateless(bf16, tok.encode(prompt), 12), tok.eos_token_id)) + "\n"
    assert "cpu, bfloat16" in err


@pytest.mark.parametrize("device, fragment", [("cuda", "CUDA is not available"), ("warp:0", "bad device"),
                                              ("mps", "MPS is not available")])
def test_generate_device_this_machine_lacks(capsys, device, fragment):
    if device == "cuda" and torch.cuda.is_available() or device == "mps" and torch.backends.mps.is_available():
        pytest.skip(f"this machine has {device}: the error under test cannot happen")
    rc, _, err = run_cli(capsys, "generate", "-p", "abc", "-n", "2", "--device", device)
    assert_one_line_error(rc, err, fragment)


def test_generate_with_checkpoint_dir(capsys, tmp_path):
    """--model DIR: weights saved by save_pretrained, a BPE tokenizer.json next to them."""
    write_bpe(tmp_path, {"eos_token": "<｜end▁of▁sentence｜>"})
    tok = load_tokenizer(tmp_path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = DS4ForCausalLM(default_config().replace(vocab_size=tok.vocab_size)).eval()
    model.save_pretrained(tmp_path)

    prompt = "To be, or not"
    rc, out, err = run_cli(capsys, "generate", "--model", str(tmp_path), "-p", prompt, "-n", "12")
    assert rc == 0, err
    expected = greedy_stateless(model, tok.encode(prompt), 12)
    if tok.eos_token_id in expected:  # generation stops after EOS
        expected = expected[: expected.index(tok.eos_token_id) + 1]
    assert out == tok.decode(expected) + "\n"


def test_generate_missing_model_dir(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    rc, _, err = run_cli(capsys, "generate", "--model", str(missing), "-p", "x")
    assert_one_line_error(rc, err, str(missing))


def test_generate_dir_without_tokenizer(capsys, tmp_path):
    default_config().save(tmp_path)
    rc, _, err = run_cli(capsys, "generate", "--model", str(tmp_path), "-p", "x")
    assert_one_line_error(rc, err, "tokenizer.json")


@pytest.mark.parametrize("command", ["generate", "info"])
@pytest.mark.parametrize("config_text, fragment", [
    ("{not json", "not valid JSON"),
    (json.dumps({**default_config().to_hf_dict(), "layer_types": ["sliding_attention"]}), "layer_types"),
])
def test_bad_config(capsys, tmp_path, command, config_text, fragment):
    write_bpe(tmp_path)
    (tmp_path / "config.json").write_text(config_text, encoding="utf-8")
    extra = ["-p", "x"] if command == "generate" else []
    rc, _, err = run_cli(capsys, command, "--model", str(tmp_path), *extra)
    assert_one_line_error(rc, err, fragment)


# --------------------------------------------------------------------------- info
def test_info_default_model(capsys, default_model):
    rc, out, _ = run_cli(capsys, "info", "--ctx", "1000")
    assert rc == 0
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert rows == [
        ["0", "sliding_attention", "-", "hash_moe"],
        ["1", "compressed_sparse_attention", "4", "moe"],
        ["2", "heavily_compressed_attention", "16", "moe"],
        ["3", "compressed_sparse_attention", "4", "moe"],
    ]
    n_params = sum(p.numel() for p in default_model.parameters())
    assert f"parameters: {n_params:,}" in out
    nbytes = default_model.new_cache(1, 1000).nbytes
    assert f"total for batch 1: {nbytes:,} bytes" in out
    assert f"{nbytes / 1000:,.1f} bytes/token" in out


def test_info_reads_config_only(capsys, tmp_path, default_model):
    """A checkpoint directory needs only config.json: info never loads weights."""
    default_config().save(tmp_path)
    rc, out, _ = run_cli(capsys, "info", "--model", str(tmp_path), "--dtype", "bfloat16")
    assert rc == 0
    assert f"parameters: {sum(p.numel() for p in default_model.parameters()):,}" in out
    assert "KV cache (bfloat16) at context 4096" in out


@pytest.mark.parametrize("argv", [["info", "--ctx", "0"], ["generate", "-p", "x", "-n", "-3"],
                                  ["bench", "model", "--prompt-len", "x"]])
def test_bad_numbers_are_usage_errors(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_bench_needs_two_new_tokens(capsys):
    rc, _, err = run_cli(capsys, "bench", "model", "--new-tokens", "1")
    assert_one_line_error(rc, err, "--new-tokens")


def test_info_subprocess():
    r = subprocess.run([sys.executable, "-m", "ds4_torch", "info"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "parameters:" in r.stdout and "bytes/token" in r.stdout



def test_loading_and_generating_leave_torch_compile_unimported():
    """A process that loads the default model and generates (the CLI, a server's core process)
    never imports torch._dynamo, an import that alone adds 1-2 s to each process start: the
    ds4 ops' registration and the model built on meta used to pull it in."""
    code = ("import sys\nfrom ds4_torch.cli import main\ntry:\n    main(['generate', '-p', 'To be', '-n', '4'])\n"
            "except SystemExit:\n    pass\nprint('imported' if 'torch._dynamo' in sys.modules else 'not imported')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "not imported", r.stdout

# --------------------------------------------------------------------------- bench, misc
def test_bench_model(capsys, tmp_path):
    table = tmp_path / "bench.csv"
    rc, out, _ = run_cli(capsys, "bench", "model", "--prompt-len", "40", "--new-tokens", "6",
                         "--threads", "1", "--csv", str(table))
    assert rc == 0
    # Same weights, both greedy: transformers must pick the same tokens as we do.
    assert "greedy tokens identical: 6/6" in out
    rows = list(csv.DictReader(table.open()))
    # the embedded model has an MTP layer: a run with one draft token by default, its counts reported
    assert [r["impl"] for r in rows] == ["ds4_torch", "transformers", "ds4_torch+mtp1"]
    for r in rows:
        assert float(r["prefill_tok_s"]) > 0 and float(r["decode_tok_s"]) > 0
        assert float(r["kv_bytes_per_token"]) > 0
    spec = rows[2]
    drafted, accepted, length = int(spec["drafted"]), int(spec["accepted"]), float(spec["acceptance_length"])
    # 5 tokens after the first, one draft per verify step: steps = drafted (none cut at the end
    # would draft 0), emitted = accepted + steps, and the mean acceptance length is emitted / steps
    steps = 5 - accepted
    assert 1 <= steps <= 5 and drafted <= steps and length == round(5 / steps, 3)
    assert int(rows[0]["drafted"]) == 0 and rows[0]["acceptance_length"] == ""
    assert "tokens identical to plain: 6/6" in out and f"{drafted} drafted, {accepted} accepted" in out


def test_bench_decode_paged_beside_static(capsys, tmp_path, monkeypatch):
    """`bench decode --cache static paged`: both caches decode the same batch in one run, the
    paged cache's logits the static cache's (max |diff| 0)."""
    from ds4_torch.bench import decode

    monkeypatch.setattr(decode, "_ops_per_step", lambda model, cache: 0)  # a trace: most of the run's time
    table = tmp_path / "decode.csv"
    rc, out, _ = run_cli(capsys, "bench", "decode", "--cache", "static", "paged", "--batch", "3", "--models",
                         "default", "--modes", "eager", "--steps", "3", "--prompt-len", "12",
                         "--threads", "1", "--csv", str(table))
    assert rc == 0
    rows = list(csv.DictReader(table.open()))
    assert [(r["cache"], r["mode"], r["batch"]) for r in rows] == [("static", "eager", "3"), ("paged", "eager", "3")]
    assert all(float(r["max_diff_vs_eager"]) == 0.0 and float(r["ms_per_step"]) > 0 for r in rows)
    assert float(rows[1]["append_ms"]) >= 0 and rows[0]["append_ms"] == ""
    assert "a 3-row eager step over the paged cache takes" in out


def test_bench_unknown_target(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "warp-drive"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert all(t in err for t in ("model", "attention", "decode", "serve"))


def test_a_benchmark_says_what_it_will_do_first_and_ctrl_c_says_it_stopped(capsys, monkeypatch):
    """Before its first measurement a benchmark names itself and its settings on stderr (its table
    comes at the end, on stdout); Ctrl-C (here, during the run) ends it with status 130 and says so."""
    import ds4_torch.bench as bench
    from ds4_torch.bench.report import progress

    def interrupted(args):
        progress(5, "bench checkpoint").update()  # under way
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "_run_checkpoint", interrupted)
    assert main(["bench", "checkpoint", "--contexts", "1024"]) == 130
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and lines[0].startswith("ds4-torch bench checkpoint: cache checkpoints") and \
        "(--contexts 1024)" in lines[0], err
    assert lines[-1] == "ds4-torch: interrupted (bench checkpoint)", err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"ds4-torch {__version__}"


# --------------------------------------------------------------------------- tokenizer vocabulary
@pytest.fixture
def padded_vocab_dir(tmp_path):
    """The default model's tokenizer next to a config whose vocabulary is 62 ids larger."""
    import shutil

    from ds4_torch.default_model import DEFAULT_MODEL_DIR

    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        shutil.copy(DEFAULT_MODEL_DIR / name, tmp_path / name)
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    config["vocab_size"] += 62
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_generate_and_serve_refuse_a_smaller_tokenizer(capsys, padded_vocab_dir):
    """Ids past the tokenizer would decode to nothing: both commands say so before loading weights."""
    from serve.cli import build_parser as serve_parser, load

    rc, _, err = run_cli(capsys, "generate", "--model", str(padded_vocab_dir), "-p", "x")
    assert_one_line_error(rc, err, "vocabulary (1038 tokens)", "vocab_size (1100)", "--allow-vocab-mismatch")
    from ds4_torch.runtime import UserError

    with pytest.raises(UserError, match=r"vocabulary \(1038 tokens\).*--allow-vocab-mismatch"):
        load(serve_parser().parse_args(["--model", str(padded_vocab_dir)]))


def test_vocab_mismatch_allowed_warns_and_a_larger_tokenizer_is_refused(capsys):
    from ds4_torch.runtime import UserError, check_tokenizer_vocabulary

    tok = default_tokenizer()
    check_tokenizer_vocabulary(tok, tok.vocab_size)
    assert capsys.readouterr().err == ""
    check_tokenizer_vocabulary(tok, tok.vocab_size + 62, allow_mismatch=True)
    assert "warning" in capsys.readouterr().err
    with pytest.raises(UserError, match="cannot embed"):
        check_tokenizer_vocabulary(tok, tok.vocab_size - 1, allow_mismatch=True)
