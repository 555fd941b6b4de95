"""Token-by-token generation on top of the model's KV cache."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from .decode import make_decoder, prefill
from .sampling import SamplingParams, sample, stop_token_ids


def generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
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
    params = SamplingParams(temperature, top_p, top_k, min_p, seed)  # fail now, not at the first token
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
    generator = params.generator(device)
    eos = stop_token_ids(extra=eos_token_id)

    # no_grad, not inference_mode: the graph decoder traces the step over the cache's tensors.
    with torch.no_grad():
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        last = prefill(model, cache, ids, prefill_chunk)[0]
        decoder = make_decoder(model, cache, decode_mode)
        for produced in range(1, max_new_tokens + 1):
            token = sample(last, params, generator)
            yield token
            if token in eos or produced == max_new_tokens:
                return
            if int(cache.positions[0]) >= cache.max_context:
                return  # no room to feed this token back: stop cleanly
            last = decoder.step(torch.tensor([token], dtype=torch.long, device=device))[0]
