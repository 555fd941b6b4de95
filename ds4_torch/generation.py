"""Token-by-token generation on top of the model's KV cache."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from .decode import make_decoder, prefill
from .sampling import BatchSampler, SamplingParams, stop_token_ids
from .speculative import SpeculationStats, Speculator, check_draft_tokens


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
    speculative_tokens: int = 0,
    stats: SpeculationStats | None = None,
    forbidden_token_ids: Iterable[int] = (),
) -> Iterator[int]:
    """Yield new token ids one at a time, as they are produced (batch size 1).

    The prompt is prefilled in chunks of ``prefill_chunk`` tokens through
    ``model(ids, cache=cache)``; then each new token is fed back alone. Stops after
    ``max_new_tokens``, after yielding an EOS token, or when the cache has no room for
    the next token (a clean stop, no exception). Without ``cache`` a fresh one sized
    ``len(prompt_ids) + max_new_tokens`` is made; with one, generation continues from
    the tokens it already holds. A prompt that does not fit raises ValueError before
    anything is yielded.

    Tokens are drawn by a one-slot `BatchSampler`: Gumbel-max with noise that depends only on
    (seed, the token's index among the generated ones), so a seed gives the same tokens however
    they are computed. ``speculative_tokens`` N (1..3; 0: off) drafts N tokens per step with the
    model's MTP layer and verifies them in one forward (:mod:`ds4_torch.speculative`): the same
    tokens, fewer forwards; its forwards run in ``decode_mode`` too (captured graphs: one per
    fixed 1 + N shape). ``stats``: a `SpeculationStats` it counts drafted and accepted tokens
    into. ``forbidden_token_ids``: tokens never generated (`SamplingParams.forbidden_token_ids`).
    """
    prompt_ids = [int(i) for i in prompt_ids]
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one token")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    params = SamplingParams(temperature, top_p, top_k, min_p, seed,  # fail now, not at the first token
                            forbidden_token_ids=forbidden_token_ids)
    check_draft_tokens(model, speculative_tokens)
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
    eos = stop_token_ids(extra=eos_token_id)

    # no_grad, not inference_mode: the graph decoder traces the step over the cache's tensors.
    with torch.no_grad():
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        if speculative_tokens:
            yield from _speculate(model, cache, ids, params, eos, max_new_tokens, prefill_chunk,
                                  speculative_tokens, stats, decode_mode)
            return
        last = prefill(model, cache, ids, prefill_chunk)[0]
        sampler = BatchSampler(1, last.shape[-1], device)
        sampler.admit(0, params)
        decoder = make_decoder(model, cache, decode_mode)
        for produced in range(1, max_new_tokens + 1):
            token = sampler.sample(last[None]).tokens
            sampler.append(token)
            token = int(token)
            yield token
            if token in eos or produced == max_new_tokens:
                return
            if int(cache.positions[0]) >= cache.max_context:
                return  # no room to feed this token back: stop cleanly
            last = decoder.step(torch.tensor([token], dtype=torch.long, device=device))[0]


def _speculate(model, cache, ids, params, eos, max_new_tokens, chunk, draft_tokens, stats, decode_mode):
    sampler = BatchSampler(1, model.config.vocab_size, ids.device)
    sampler.admit(0, params)
    spec = Speculator(model, cache, sampler, draft_tokens, stats, mode=decode_mode)
    token, _ = spec.start(ids, chunk)
    unused = 0  # tokens of the last step not taken (after an EOS, or when the caller stops)
    try:
        yield token
        produced = 1
        while token not in eos and produced < max_new_tokens and spec.room() >= 0:
            tokens, _ = spec.step(max_new_tokens - produced)
            for i, token in enumerate(tokens):
                unused = len(tokens) - i - 1
                yield token
                produced += 1
                if token in eos:
                    return
    finally:
        spec.finish(unused)  # the cache as plain decoding leaves it, however the caller stops
