"""Token-by-token generation on top of the model's KV cache."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from .decode import make_decoder, prefill


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """Raise ValueError for sampling settings that make no sense."""
    if not temperature >= 0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> int:
    """Pick the next token id from one row of logits ``[V]``.

    ``temperature == 0`` is greedy (argmax; ``top_p``/``top_k`` are then irrelevant).
    Otherwise: scale by 1/temperature, keep the ``top_k`` best (0 = all), keep the
    smallest set of best tokens whose probability reaches ``top_p``, sample with
    ``generator`` (which must live on the logits' device).
    """
    check_sampling(temperature, top_p, top_k)
    logits = logits.reshape(-1).float()
    if temperature == 0:
        return int(torch.argmax(logits))

    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the better ones before it already reach top_p; the best
        # token always stays (its preceding mass is 0).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits[order[drop]] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _eos_set(eos_token_id: int | Iterable[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset((eos_token_id,))
    return frozenset(int(i) for i in eos_token_id)


def generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    eos_token_id: int | Iterable[int] | None = None,
    prefill_chunk: int = 256,
    cache=None,
    decode_mode: str = "auto",
) -> Iterator[int]:
    """Yield new token ids one at a time, as they are produced (batch size 1).

    The prompt is prefilled in chunks of ``prefill_chunk`` tokens through
    ``model(ids, cache=cache)``; then each new token is fed back alone. Stops after
    ``max_new_tokens``, after yielding an EOS token, or when the cache has no room for
    the next token (a clean stop, no exception). Without ``cache`` a fresh one sized
    ``len(prompt_ids) + max_new_tokens`` is made; with one, generation continues from
    the tokens it already holds. A prompt that does not fit raises ValueError before
    anything is yielded.
    """
    prompt_ids = [int(i) for i in prompt_ids]
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one token")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    check_sampling(temperature, top_p, top_k)  # fail now, not at the first sampled token
    if max_new_tokens <= 0:
        return
    if cache is None:
        cache = model.new_cache(batch_size=1, max_context=len(prompt_ids) + max_new_tokens)
    room = cache.max_context - int(cache.positions[0])
    if len(prompt_ids) > room:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens does not fit in the cache "
            f"({room} of {cache.max_context} positions free)"
        )

    device = next(model.parameters()).device
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
    eos = _eos_set(eos_token_id)

    # no_grad, not inference_mode: the graph decoder traces the step over the cache's tensors.
    with torch.no_grad():
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        last = prefill(model, cache, ids, prefill_chunk)[0]
        decoder = make_decoder(model, cache, decode_mode)
        for produced in range(1, max_new_tokens + 1):
            token = sample_next(last, temperature, top_p, top_k, generator)
            yield token
            if token in eos or produced == max_new_tokens:
                return
            if int(cache.positions[0]) >= cache.max_context:
                return  # no room to feed this token back: stop cleanly
            last = decoder.step(torch.tensor([token], dtype=torch.long, device=device))[0]
