"""Branch and rewind a conversation with cache checkpoints, and check them against cold runs.

    python examples/branch_conversation.py

With the embedded default model, on CPU, in seconds:

1. Conversation A (a system prompt, a user message) is prefilled into slot 0 of a cache, with a
   checkpoint taken where the system prompt ends and another at the end of the prompt (with the
   next token's logits); then the model answers it.
2. Regenerate: slot 0 is rewound to the end of A's prompt. The checkpoint's logits give the first
   token with no recompute, and the greedy reply is the same as the first time.
3. Branch: conversation B (the same system prompt, another user message) starts in slot 1 from
   slot 0's compressed rows and the system-prompt checkpoint; only B's own tokens are prefilled.
   Its logits are compared with a cold run of B in a fresh cache, fed in the same pieces (bit
   for bit on CPU) and at once (prefill chunking alone moves logits by about 1e-5).
"""
from __future__ import annotations

import torch

from ds4_torch import generate, prefill
from ds4_torch.chat_encoding import render_prompt
from ds4_torch.default_model import build_default_model, default_tokenizer

SYSTEM = ("You are a player in a company of actors. Answer in the manner of the plays, briefly, and keep to "
          "the scene you are given.")
REPLY_TOKENS = 12
CONTEXT = 256


def greedy_reply(model, cache, first_logits) -> list[int]:
    """Greedy tokens continuing a batch-1 `cache` whose next-token logits are `first_logits`."""
    first = int(first_logits.argmax())
    return [first] + list(generate(model, [first], REPLY_TOKENS - 1, cache=cache, decode_mode="eager"))


def cold_logits(model, tokens: list[int], split: int | None = None) -> torch.Tensor:
    """Next-token logits of `tokens` in a fresh cache: fed at once, or up to `split` then the rest."""
    cache = model.new_cache(1, CONTEXT)  # the same capacity as the branched run's cache
    pieces = [tokens] if split is None else [tokens[:split], tokens[split:]]
    for piece in pieces:
        logits = prefill(model, cache, torch.tensor([piece]), chunk=len(piece))
    return logits[0]


@torch.no_grad()
def main() -> dict:
    model, tok = build_default_model(), default_tokenizer()
    system_ids = tok.encode(render_prompt([{"role": "system", "content": SYSTEM}], add_generation_prompt=False),
                            add_special_tokens=False)
    a_ids = tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who goes there?"}])
    b_ids = tok.encode_chat([{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": "What news from Verona?"}])
    at = len(system_ids)
    assert a_ids[:at] == system_ids == b_ids[:at], "the system prompt's tokens start both prompts"
    cache = model.new_cache(batch_size=2, max_context=CONTEXT)
    slot_a, slot_b = cache.slot(0), cache.slot(1)

    # 1. conversation A, checkpointed at the system prompt's end and at the prompt's end
    prefill(model, slot_a, torch.tensor([a_ids[:at]]))
    after_system = cache.take_checkpoint(0)
    logits = prefill(model, slot_a, torch.tensor([a_ids[at:]]))[0]
    end_of_prompt = cache.take_checkpoint(0, logits)
    first_reply = greedy_reply(model, slot_a, logits)
    print(f"A: {len(a_ids)} prompt tokens, checkpoints at {at} (system prompt) and {len(a_ids)} (prompt end), "
          f"{cache.checkpoint_nbytes()} bytes each without logits")
    print(f"A's reply: {tok.decode(first_reply)!r}")

    # 2. regenerate: rewind slot 0 to the end of A's prompt; nothing is prefilled
    cache.restore_checkpoint(0, end_of_prompt)
    again = greedy_reply(model, slot_a, end_of_prompt["logits"])
    print(f"regenerated after a rewind to {len(a_ids)} (0 tokens prefilled): same reply: {again == first_reply}")

    # 3. branch B from slot 0 at the system prompt's checkpoint; prefill only B's own tokens
    cache.branch_from_checkpoint(1, 0, after_system)
    logits_b = prefill(model, slot_b, torch.tensor([b_ids[at:]]))[0]
    same_pieces = (logits_b - cold_logits(model, b_ids, split=at)).abs().max().item()
    at_once = (logits_b - cold_logits(model, b_ids)).abs().max().item()
    reply_b = greedy_reply(model, slot_b, logits_b)
    cold_cache = model.new_cache(1, CONTEXT)
    cold_reply_b = greedy_reply(model, cold_cache, prefill(model, cold_cache, torch.tensor([b_ids]))[0])
    print(f"B: {len(b_ids)} prompt tokens, {at} reused from A's slot, {len(b_ids) - at} prefilled")
    print(f"B's logits vs a cold run: max |difference| {same_pieces:.3g} (fed in the same pieces), "
          f"{at_once:.3g} (fed at once)")
    print(f"B's reply: {tok.decode(reply_b)!r}; same as the cold run's: {reply_b == cold_reply_b}")
    return {"reused": at, "prompt_b": len(b_ids), "regenerated_same": again == first_reply,
            "same_pieces": same_pieces, "at_once": at_once, "logit_scale": logits_b.abs().max().item(),
            "reply_same": reply_b == cold_reply_b}


if __name__ == "__main__":
    main()
