"""What the server's flags build, in whichever process needs it: the model, its tokenizer and the
`ServerConfig` (the engine core's process, or the one process with `--engine-core thread`), the
disk KV store (beside the engine), and what an API process loads (the tokenizer and the model's
config, no weights). serve.cli parses the flags; serve.core.process and serve.core.api_process use this too.
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


KV_MEMORY_SHARE = 0.5  # of the memory left after the weights, what the KV cache may take by default


def choose_kv_pool(model, ctx: int | None, max_sessions: int | None, max_batch: int, kv_cache_mb: float | None,
                   block_tokens: int, group=None, kv_rows: str = "full") -> tuple[float, int]:
    """(the KV pool's MiB, the per-request --ctx) the server runs with. Default pool: half of the
    memory left after the weights, less every slot's own state (window ring, open windows, block
    table), and at most the blocks every slot would hold at the context (the requests' total
    cannot need more). Default context: the model's maximum; either way at most what the pool
    holds for one request. Under tensor parallelism (`group`) the smallest of the ranks' pools, so
    all agree. Both choices are logged."""
    import math

    from ds4_torch.footprint import free_memory, sequence_fixed_bytes
    from ds4_torch.paged import block_nbytes, pool_blocks

    from serve.engine.loop import cache_slots

    config, dtype, log = model.config, model.dtype, logging.getLogger("ds4.serve")
    sessions, batch_slots = cache_slots(max_batch, max_sessions)
    slots = sessions + batch_slots
    maximum = config.max_position_embeddings
    context = ctx or maximum
    block = block_nbytes(config, dtype, block_tokens, kv_rows)
    rates = {config.compress_rate(i) for i in range(config.num_hidden_layers)} - {0}
    per_slot = sequence_fixed_bytes(config, dtype) + 8 * sum(math.ceil(context / m) + 1 for m in rates)
    if kv_cache_mb is None:
        free = free_memory(model.device)
        budget = free * KV_MEMORY_SHARE - slots * per_slot
        blocks = max(0, min(int(budget // block), slots * math.ceil(context / block_tokens)))
        if group is not None:
            import torch
            import torch.distributed as dist

            agreed = torch.tensor([blocks])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
            blocks = int(agreed)
        if blocks < 2:
            raise UserError(f"the KV cache of {sessions} sessions and {batch_slots} batch slots does not fit in half of "
                            f"the {free / 2**20:,.0f} MiB left on {model.device}: lower --max-sessions / --max-batch "
                            f"or --ctx, or give --kv-cache-mb")
        kv_cache_mb = blocks * block / 2**20
        log.info("--kv-cache-mb %.1f: %d blocks of %d tokens (%s bytes each), %s of the %s MiB left on %s after the "
                 "weights (%d%% may go to the KV cache, less %s MiB for %d slots' own state)", kv_cache_mb, blocks,
                 block_tokens, f"{block:,}", "every slot at --ctx" if blocks == slots * math.ceil(context / block_tokens)
                 else "what fits", f"{free / 2**20:,.0f}", model.device, KV_MEMORY_SHARE * 100,
                 f"{slots * per_slot / 2**20:,.1f}", slots)
    blocks = pool_blocks(config, dtype, kv_cache_mb * 2**20, block_tokens, kv_rows)
    if blocks < 2:
        raise UserError(f"--kv-cache-mb {kv_cache_mb} holds {blocks} KV block(s) of {block_tokens} tokens "
                        f"({block:,} bytes each); at least 2 are needed")
    cap = (blocks - 1) * block_tokens  # a sequence's blocks, and the copy of one it shares
    if ctx is not None and ctx > cap:
        log.warning("--ctx %d lowered to %d: what the KV pool (%d blocks of %d tokens) holds for one request", ctx, cap,
                    blocks, block_tokens)
    context = min(context, cap)
    if ctx is None:
        log.info("--ctx %d per request (%s)", context, "the model's maximum" if context == maximum else
                 f"what the KV pool holds for one request; the model allows {maximum}")
    return kv_cache_mb, context


def load(args, group=None):
    """(model, tokenizer, ServerConfig) for parsed arguments; UserError on user errors. `group`:
    the tensor-parallel ranks' control group (they agree on the default context)."""
    from serve.http.app import ServerConfig

    tokenizer = load_model_tokenizer(args.model)
    check_tokenizer_vocabulary(tokenizer, load_config(args.model).vocab_size, args.allow_vocab_mismatch)
    model = load_model(args.model, device=args.device, dtype=args.dtype, tp=args.tp, quantized=args.quantized)
    # (serve.cli.check_flags has checked what needs no weights, before anything loaded)
    if args.speculative_tokens and getattr(model, "mtp", None) is None:
        raise UserError(f"--speculative-tokens {args.speculative_tokens} needs a model with an MTP layer "
                        "(num_nextn_predict_layers >= 1 and mtp.* weights); this one has none")
    args.kv_cache_mb, args.ctx = choose_kv_pool(model, args.ctx, args.max_sessions, args.max_batch, args.kv_cache_mb,
                                                args.kv_block_tokens, group, args.kv_dtype)
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
        kv_cache_mb=args.kv_cache_mb, kv_block_tokens=args.kv_block_tokens, kv_rows=args.kv_dtype,
        kv_disk_dir=args.kv_disk_dir, kv_disk_space_mb=args.kv_disk_space_mb,
        keepalive_interval=args.keepalive_interval, served_model_names=tuple(args.served_model_name),
        strict_model_name=args.strict_model_name, access_log=args.access_log == "on", host=args.host,
        allowed_hosts=tuple(args.allowed_hosts), cors_origins=tuple(args.cors_origins),
        kv_events=args.kv_events, kv_events_replay=args.kv_events_replay,
    )
    return model, tokenizer, config


def check_kv_events(args) -> None:
    """UserError for --kv-events flags that do not go together. Several API keys are several
    tenants: their blocks' token ids go to every subscriber only when --kv-events-all-tenants says so."""
    if args.kv_events is None:
        for flag, given in (("--kv-events-replay", args.kv_events_replay is not None),
                            ("--kv-events-all-tenants", args.kv_events_all_tenants)):
            if given:
                raise UserError(f"{flag} needs --kv-events ENDPOINT")
        return
    keys = len(set(args.api_key or ()))
    if keys > 1 and not args.kv_events_all_tenants:
        raise UserError(f"--kv-events publishes the token ids of every block the KV pool caches, and with {keys} "
                        f"--api-key values they are {keys} tenants' prompts: anyone who connects to {args.kv_events} "
                        f"reads them all. Add --kv-events-all-tenants if its subscribers may (a router in front of "
                        f"every tenant sees their requests anyway), or run one server per tenant")


def warn_if_open(host: str, api_key) -> None:
    """One warning when the server listens beyond loopback (any 127.x address, ::1, localhost) with
    no key: anyone who can reach the address can use it."""
    import ipaddress

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        loopback = False
    if not loopback and not api_key:
        logging.getLogger("ds4.serve").warning("binding to %s without --api-key: anyone who can reach it can use it",
                                               host)


def _api_key(keys: list[str]) -> str | tuple[str, ...]:
    """One key as before (a string), several as a tuple: each its own tenant."""
    keys = list(dict.fromkeys(keys))
    return keys[0] if len(keys) == 1 else tuple(keys)


def attach_kv_store(engine, args):
    """Give `engine` (an `Engine`) a disk KV store when `--kv-disk-dir` is set (its metrics go to
    the engine's registry). Returns the store, or None."""
    from serve.kvstore.store import KVStore

    if args.kv_disk_dir is None:
        return None
    try:
        store = KVStore(args.kv_disk_dir, args.kv_disk_space_mb or KV_DISK_DEFAULT_MB, engine.model, ctx=engine.ctx,
                        dtype=engine.resident.dtype, kv_rows=engine.resident.kv_rows.name, every=args.kv_disk_every, min_tokens=args.kv_disk_min_tokens,
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
