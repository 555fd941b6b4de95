"""First contact in prose: plain prompts, no tools offered, through chat completions,
Anthropic Messages and Responses, greedy and sampled at T=0.8, are answered in prose.

A reply is prose (`is_prose`) when it has visible text, no C0 control character other than
newline and tab, no U+FFFD, and none of the call markup the stage-3 weights spelled with ordinary
tokens when the server masked their call opener (`string="`, `name="`, `">`) nor DSML, think or
tool-result tags or special tokens. The rule says nothing about what the text means. At least
95% of the replies must be prose, per API and per mode, and every reply to the first five prompts
(those on which the stage-3 weights' fragments were first reported).

The prompts (tests/data/plain_prompts.json) are what a newcomer types first; none is a prompt
examples/train_chat.py trains on. Sampled replies are seeded, prompt i with SEED + i, through
every API: chat completions takes the seed; Responses and Messages have no seed field, so this
module's server gives their requests, which come without one, the seed of their prompt where it
would otherwise draw one at random (`seeded_by_prompt`), and the same draws come every run.

The shipped stage-4 weights pass; the stage-3 weights before them (commit 5112a75's
model.safetensors) failed it by hand (the numbers are in docs/default-model.md).
"""
from __future__ import annotations

import dataclasses
import json
import unicodedata
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest

from ds4_torch.chat_encoding import ASSISTANT, USER
from ds4_torch.default_model import DEFAULT_MODEL_DIR
from ds4_torch.sampling import BatchSampler
from helpers import DATA, MODEL, server

PROMPTS = json.loads((DATA / "plain_prompts.json").read_text(encoding="utf-8"))["prompts"]
FIRST_PROMPTS = ["Hello", "What news?", "Who are you?", "Tell me a story about a king.", "How are you today?"]
SEED = 4200            # sampled: prompt i draws with seed SEED + i
TEMPERATURE = 0.8
MAX_TOKENS = 32
SHARE = 0.95           # of the replies, per API and mode, that must be prose

# The call markup the stage-3 weights wrote in plain chat, and the protocol's tags and special
# tokens (every one holds `<｜`, `｜>`, DSML or a think / tool-result tag).
MARKUP = ('string="', 'name="', '">', "<｜", "｜>", "DSML", "<think>", "</think>", "<tool_result>", "</tool_result>")
CONTROL = frozenset(chr(c) for c in range(0x20)) - {"\n", "\t"}


def is_prose(text: str | None) -> bool:
    """Visible text, no C0 control character but newline and tab, no U+FFFD,
    no call-markup fragment or special token."""
    if not text or not any(not ch.isspace() and unicodedata.category(ch)[0] != "C" for ch in text):
        return False
    if CONTROL.intersection(text) or "\ufffd" in text:
        return False
    return not any(fragment in text for fragment in MARKUP)


# --------------------------------------------------------------------------- the rule
def test_the_rule_rejects_what_the_old_model_wrote_and_accepts_shakespeare():
    """Against independent material: fragments the stage-3 weights wrote, every added token of the
    model's tokenizer (tokenizer.json, the protocol's markup and special tokens), and lines of
    held-out Tiny Shakespeare (the text the model learned to write)."""
    for bad in ['" string="true">RB', 'name="city" string="true">Warsaw', "Hoo\x0bad", "\x1f", "a\x08b", "\x05 king",
                "the king\ufffd", "", "  \n\t ", "\u200b", '">">">', "well</think>", "<｜end▁of▁sentence｜>", "<think>",
                "I\rsay"]:
        assert not is_prose(bad), repr(bad)
    added = json.loads((DEFAULT_MODEL_DIR / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    assert len(added) >= 14
    for token in added:
        assert not is_prose("Good morrow" + token["content"] + "sir"), token["content"]
    held = (DATA / "tinyshakespeare_held_out.txt").read_text(encoding="utf-8")
    speeches = [s for s in held.split("\n\n") if s.strip()]
    assert len(speeches) >= 10 and all(is_prose(s) for s in speeches)
    assert is_prose("Hello! How can I help you today?") and is_prose("ROMEO:\n\tOne that will be satisfied.")


# --------------------------------------------------------------------------- the guard
@pytest.fixture(scope="module")
def seeded():
    """The prompts whose unseeded sampled requests got their prompt's seed."""
    return set()


@pytest.fixture(scope="module")
def srv(model, tok, seeded):
    admit = BatchSampler.admit

    def seeded_by_prompt(self, slot, params, prompt_ids=(), *args, **kwargs):
        """A sampled request without a seed (Responses, Messages) gets its prompt's: SEED + i."""
        if params.seed is None and params.temperature > 0:
            user = tok.decode(list(prompt_ids), skip_special_tokens=False).rsplit(USER, 1)[-1].split(ASSISTANT, 1)[0]
            if user in PROMPTS:
                params = dataclasses.replace(params, seed=SEED + PROMPTS.index(user))
                seeded.add(user)
        return admit(self, slot, params, prompt_ids, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BatchSampler, "admit", seeded_by_prompt)
        with server(model, tok, ctx=512, max_batch=16) as s:
            yield s


def replies(srv, api: str, temperature: float) -> list[str | None]:
    """The reply text of every prompt through `api`, sent concurrently (the server batches them)."""
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
    ant = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=300)

    def ask(i: int) -> str | None:
        p = PROMPTS[i]
        if api == "chat":
            seed = {"seed": SEED + i} if temperature else {}
            r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                            max_tokens=MAX_TOKENS, temperature=temperature, **seed)
            assert not r.choices[0].message.tool_calls, (p, r.choices[0].message.tool_calls)
            return r.choices[0].message.content
        if api == "responses":
            r = oai.responses.create(model=MODEL, input=p, max_output_tokens=MAX_TOKENS, temperature=temperature)
            assert not [o for o in r.output if o.type == "function_call"], (p, r.output)
            return r.output_text
        m = ant.messages.create(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS,
                                extra_body={"temperature": temperature})  # (this SDK's create has no temperature)
        assert all(b.type == "text" for b in m.content), (p, m.content)
        return "".join(b.text for b in m.content)

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(ask, range(len(PROMPTS))))


@pytest.mark.parametrize("temperature", [0.0, TEMPERATURE], ids=["greedy", "sampled"])
def test_plain_prompts_are_answered_in_prose(srv, seeded, temperature):
    assert len(PROMPTS) >= 30 and len(set(PROMPTS)) == len(PROMPTS) and set(FIRST_PROMPTS) <= set(PROMPTS)
    report, failed = [], False
    for api in ("chat", "messages", "responses"):
        texts = replies(srv, api, temperature)
        bad = [(i, t) for i, t in enumerate(texts) if not is_prose(t)]
        share = 1 - len(bad) / len(texts)
        failed |= share < SHARE or any(PROMPTS[i] in FIRST_PROMPTS for i, _ in bad)  # the first five: every one
        report.append(f"{api}: {len(texts) - len(bad)}/{len(texts)} prose ({share:.1%})")
        report += [f"  prompt {i} {PROMPTS[i]!r}" + (f" seed {SEED + i}" if temperature else "") + f": {t!r}"
                   for i, t in bad]
    if temperature:
        assert seeded == set(PROMPTS), "a Responses or Messages request drew without its prompt's seed"
    mode = f"sampled at T={temperature}, max_tokens {MAX_TOKENS}" if temperature else f"greedy, max_tokens {MAX_TOKENS}"
    assert not failed, (f"fewer than {SHARE:.0%} of the replies are prose, or a reply to one of the first five "
                        f"prompts is not ({mode}):\n" + "\n".join(report))
