"""lm-evaluation-harness against a live server, unchanged: `lm_eval --model local-completions`
runs the two local tasks of examples/lm_eval (a multiple-choice loglikelihood task and a
loglikelihood_rolling perplexity task) over /v1/completions (`echo`, `logprobs`, token-id
prompts), and every per-document number it logs equals what the model's own forward gives for
the same tokens. lm_eval[api] is in the dev extra; nothing is fetched from the hub (its cache
is a fresh directory and the hub is off)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import reference_logprobs, server

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "ds4_torch" / "assets" / "tiny-shakespeare"
MAX_LENGTH = 256


def _missing() -> str | None:
    for module in ("lm_eval", "tenacity", "aiohttp"):
        if importlib.util.find_spec(module) is None:
            return module
    return None


def _samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def _score(model, ids: list[int], start: int) -> tuple[float, bool]:
    """Sum of the model's log-probabilities of ids[start:] given what precedes, and whether each
    is the argmax (lm_eval's is_greedy)."""
    ref = reference_logprobs(model, ids)
    rows = ref[start - 1:len(ids) - 1]
    targets = torch.tensor(ids[start:])
    return float(rows.gather(1, targets[:, None]).sum()), bool((rows.argmax(-1) == targets).all())


def test_lm_eval_loglikelihood_and_rolling_match_the_models_forward(tmp_path, model, tok):
    missing = _missing()
    assert not missing, f"lm_eval[api] is not installed ({missing} missing): pip install -e '.[dev]'"
    with server(model, tok, ctx=2 * MAX_LENGTH, prefill_chunk=64) as srv:
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   HF_HOME=str(tmp_path / "hf"))  # an empty cache: the local tasks need nothing stored
        cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
               f"model=ds4-default,base_url={srv.url}/v1/completions,tokenizer={TOKENIZER},max_length={MAX_LENGTH}",
               "--tasks", "ds4_tiny_choice,ds4_tiny_perplexity", "--include_path", "examples/lm_eval",
               "--output_path", str(tmp_path / "out"), "--log_samples"]
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]

    # loglikelihood_rolling: one window per text (all shorter than max_length), after lm_eval's
    # prefix token (the tokenizer's BOS).
    rolling = _samples(tmp_path / "out", "ds4_tiny_perplexity")
    assert len(rolling) == 3
    for s in rolling:
        ids = tok.encode(s["doc"]["text"], add_special_tokens=False)
        assert len(ids) < MAX_LENGTH
        expected, _ = _score(model, [tok.hf.bos_token_id] + ids, 1)
        assert float(s["filtered_resps"][0]) == pytest.approx(expected, abs=1e-3)

    # loglikelihood (multiple choice): each choice's continuation given the context, tokenized
    # as lm_eval does (the whole text, the context's tokens first).
    choice = _samples(tmp_path / "out", "ds4_tiny_choice")
    assert len(choice) == 4
    for s in choice:
        for k, (ll, greedy) in enumerate(s["filtered_resps"]):
            args = s["arguments"][f"gen_args_{k}"]
            context, continuation = args["arg_0"], args["arg_1"]
            whole = tok.encode(context + continuation, add_special_tokens=False)
            start = len(tok.encode(context, add_special_tokens=False))
            expected, is_greedy = _score(model, whole, start)
            assert float(ll) == pytest.approx(expected, abs=1e-3)
            assert (greedy == "True") == is_greedy
        # acc is right for these numbers: the highest loglikelihood is the model's pick
        pick = max(range(len(s["filtered_resps"])), key=lambda k: float(s["filtered_resps"][k][0]))
        assert s["acc"] == float(pick == s["doc"]["answer"])
