"""What the server's flags build, in whichever process needs it: the model, its tokenizer and the
`ServerConfig` (the engine core's process, or the one process with `--engine-core thread`), the
disk KV store (beside the engine), and what an API process loads (the tokenizer and the model's
config, no weights). serve.cli parses the flags; serve.core and serve.api_process use this too.
"""
from __future__ import annotations

import logging
import os

from ds4_torch.runtime import (UserError, check_tokenizer_vocabulary, load_config, load_model,
                               load_model_tokenizer)

KV_DISK_DEFAULT_MB = 1024
REPLAY_SHARE = 8  # the exact-replay records may take 1/8 of --kv-disk-space-mb (the snapshots make room)
KV_DISK_DEFAULT_EVERY = 512
KV_DISK_DEFAULT_MIN_TOKENS = 32
API_KEY_ENV = "DS4_TORCH_API_KEY"


def choose_context(model, max_sessions: int | None, max_batch: int, group=None) -> int:
    """The default `--ctx`: the model's maximum when the caches of every session and batch slot
    fit in half of the memory left after the weights, else the largest context that fits.
    Under tensor parallelism (`group`), the smallest of the ranks' choices, so all agree."""
    from ds4_torch.footprint import cache_bytes, fitting_context, free_memory

    from .engine import cache_slots

    sessions, batch_slots = cache_slots(max_batch, max_sessions)
    slots = sessions + batch_slots
    free = free_memory(model.device)
    ctx = fitting_context(model.config, model.dtype, slots, free // 2)
    if group is not None:
        import torch
        import torch.distributed as dist

        agreed = torch.tensor([ctx])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        ctx = int(agreed)
    if ctx == 0:
        raise UserError(f"the KV caches of {sessions} sessions and {slots - sessions} batch slots do not fit in half "
                        f"of the {free / 2**20:,.0f} MiB left on {model.device} even at 1024 tokens: lower "
                        f"--max-sessions / --max-batch or give --ctx")
    maximum = model.config.max_position_embeddings
    logging.getLogger("ds4.serve").info(
        "--ctx %d (%s): KV caches of %d sessions + %d batch slots take %s MiB of the %s MiB left on %s "
        "after the weights (half of it may go to them)", ctx,
        "the model's maximum" if ctx == maximum else f"the largest that fits; the model allows {maximum}",
        sessions, slots - sessions, f"{cache_bytes(model.config, ctx, slots, model.dtype) / 2**20:,.0f}",
        f"{free / 2**20:,.0f}", model.device)
    return ctx


def load(args, group=None):
    """(model, tokenizer, ServerConfig) for parsed arguments; UserError on user errors. `group`:
    the tensor-parallel ranks' control group (they agree on the default context)."""
    from .app import ServerConfig

    tokenizer = load_model_tokenizer(args.model)
    check_tokenizer_vocabulary(tokenizer, load_config(args.model).vocab_size, args.allow_vocab_mismatch)
    model = load_model(args.model, device=args.device, dtype=args.dtype, tp=args.tp, quantized=args.quantized)
    if args.max_sessions is not None and args.max_sessions < args.max_batch:
        raise UserError(f"--max-sessions {args.max_sessions} is less than --max-batch {args.max_batch}: every "
                        "decoding request holds a resident session")
    if args.speculative_tokens and getattr(model, "mtp", None) is None:
        raise UserError(f"--speculative-tokens {args.speculative_tokens} needs a model with an MTP layer "
                        "(num_nextn_predict_layers >= 1 and mtp.* weights); this one has none")
    if args.ctx is None:
        args.ctx = choose_context(model, args.max_sessions, args.max_batch, group)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and args.ctx > limit:
        raise UserError(f"--ctx {args.ctx} is larger than the model's max_position_embeddings ({limit})")
    if args.model is None:
        name, aliases = "ds4-default", ()
    else:
        name = os.path.basename(os.path.normpath(args.model))
        aliases = (args.model, os.path.abspath(args.model))
    config = ServerConfig(
        model_name=name, model_aliases=aliases, ctx=args.ctx, prefill_chunk=args.prefill_chunk,
        decode_mode=args.decode_mode, max_queue=args.max_queue, max_batch=args.max_batch,
        max_sessions=args.max_sessions, speculative_tokens=args.speculative_tokens,
        speculative_max_batch=args.speculative_max_batch, speculative_policy=args.speculative_policy,
        tool_call_grammar=not args.free_tool_calls,
        api_key=_api_key(args.api_key) if args.api_key else (os.environ.get(API_KEY_ENV) or None),
        checkpoint_interval=args.checkpoint_interval, checkpoint_memory_mb=args.checkpoint_memory_mb,
        kv_disk_dir=args.kv_disk_dir, kv_disk_space_mb=args.kv_disk_space_mb,
        keepalive_interval=args.keepalive_interval, served_model_names=tuple(args.served_model_name),
        strict_model_name=args.strict_model_name, access_log=args.access_log == "on", host=args.host,
        allowed_hosts=tuple(args.allowed_hosts), cors_origins=tuple(args.cors_origins),
    )
    return model, tokenizer, config


def _api_key(keys: list[str]) -> str | tuple[str, ...]:
    """One key as before (a string), several as a tuple: each its own tenant."""
    keys = list(dict.fromkeys(keys))
    return keys[0] if len(keys) == 1 else tuple(keys)


def attach_kv_store(engine, args):
    """Give `engine` (an `Engine`) a disk KV store when `--kv-disk-dir` is set (its metrics go to
    the engine's registry). Returns the store, or None."""
    from .kvstore import KVStore

    if args.kv_disk_dir is None:
        if args.kv_disk_space_mb is not None:
            raise UserError("--kv-disk-space-mb needs --kv-disk-dir")
        return None
    try:
        store = KVStore(args.kv_disk_dir, args.kv_disk_space_mb or KV_DISK_DEFAULT_MB, engine.model, ctx=engine.ctx,
                        dtype=engine.resident.dtype, every=args.kv_disk_every, min_tokens=args.kv_disk_min_tokens,
                        registry=engine.metrics.registry)
    except (OSError, RuntimeError) as e:
        raise UserError(f"--kv-disk-dir {args.kv_disk_dir}: {e}") from e
    engine.kv_store = store
    return store


def load_api_side(args):
    """What an API process loads: the tokenizer and the model's config (not the weights)."""
    tokenizer = load_model_tokenizer(args.model)
    model_config = load_config(args.model)
    check_tokenizer_vocabulary(tokenizer, model_config.vocab_size, args.allow_vocab_mismatch)
    return tokenizer, model_config
