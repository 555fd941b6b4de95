"""One process's model and KV caches, and every operation the engine runs on them.

The engine (serve.engine.loop) decides; a `Replica` executes. Every call that touches the model or a
cache is a method here taking plain, picklable arguments (slot numbers, token id lists, cache
names), so that under tensor parallelism rank 0 can send each call to the other ranks before
running it (serve.core.tp): every rank holds a `Replica` of the same shape and runs the same calls in
the same order, which is what keeps their collectives matched and their caches (replicated per
rank) equal. In a single process the engine calls its replica directly.

Cache names: "resident" (one conversation per slot, kept between requests) and "batch" (the
sequences decoding together). Both are views of one `PagedDS4Cache` (`kv`): its first
`batch_slots` sequences are the batch, the rest the resident slots, and every sequence's
compressed and indexer rows live in blocks of one pool (`kv.pool`). A slot holds only its window
ring, open windows and block table; a copy between slots shares the source's blocks (a fork), so
a session joining or leaving the batch, a fork or a branch copies no rows, and a prefix held by
several sessions is stored once. Under tensor parallelism every rank runs the same operations in
the same order, so the ranks' block tables stay identical.

The batched sampler (`ds4_torch.sampling.BatchSampler`, one slot per batch slot) lives here too:
rank 0's runner samples with it; when speculating, the other ranks need the same drafts, so
every rank keeps it in the same state (the runner sends its writes as operations) and a
speculative step (`speculate`, through `ds4_torch.speculative.Speculator`) runs whole on each.

Checkpoints (`DS4Cache.take_checkpoint`) live in the replica, under ids the engine chooses, so
each rank holds its own copy, on its own device: taking, restoring, branching from, importing and
dropping one are replica operations like the others (cache operations: they run no collective).
"""
from __future__ import annotations

import logging

import torch

from ds4_torch.decode import make_decoder, prefill
from ds4_torch.paged import DEFAULT_BLOCK_TOKENS, PagedDS4Cache
from ds4_torch.sampling import BatchSampler, SamplingParams
from ds4_torch.speculative import Speculator

log = logging.getLogger("ds4.serve")

# The operations that run the model: under tensor parallelism each is a series of collectives,
# which cannot run once the group is broken (cache copies and resets are local).
MODEL_OPERATIONS = frozenset({"warmup", "prefill", "decode", "join", "speculate"})


class Replica:
    def __init__(self, model, *, ctx: int, sessions: int, batch_slots: int, decode_mode: str,
                 speculative_tokens: int = 0, kv_blocks: int | None = None,
                 kv_block_tokens: int = DEFAULT_BLOCK_TOKENS, kv_rows: str = "full"):
        self.model, self.ctx, self.decode_mode = model, ctx, decode_mode
        self.device = model.device
        self.batch_slots = batch_slots
        # (kv_blocks None: as many blocks as static caches of every slot at ctx would hold)
        self.kv = PagedDS4Cache(model.config, batch_slots + sessions, ctx, dtype=model.dtype, device=model.device,
                                num_blocks=kv_blocks, block_tokens=kv_block_tokens, kv_rows=kv_rows)
        self.pool = self.kv.pool
        self.batch = self.kv.narrow(batch_slots)
        self.resident = self.kv._view(batch_slots, sessions)
        self.decoder = make_decoder(model, self.batch, decode_mode, scratch_padding=True)
        self.checkpoints: dict = {}  # checkpoint id -> `DS4Cache.take_checkpoint` (no logits: rank 0 keeps those)
        self.sampler = BatchSampler(batch_slots, model.config.vocab_size, self.device)
        self.speculative_tokens = speculative_tokens
        self.speculator = (Speculator(model, self.batch, self.sampler, speculative_tokens, batch=batch_slots,
                                      mode=decode_mode) if speculative_tokens else None)
        # Speculating: resident slot -> (its position, the main model's hidden streams at the last
        # position a prefill fed), so the next chunk (`prefill`'s carry) or the request's first
        # draft (`join`) goes on from there. Dropped whenever the slot's contents change otherwise.
        self.carry: dict[int, tuple[int, torch.Tensor]] = {}

    def shape(self) -> dict:
        """The constructor's arguments (besides the model): another rank builds the same replica."""
        return dict(ctx=self.ctx, sessions=self.resident.batch_size, batch_slots=self.batch.batch_size,
                    decode_mode=self.decode_mode, speculative_tokens=self.speculative_tokens,
                    kv_blocks=self.pool.num_blocks, kv_block_tokens=self.pool.block_tokens,
                    kv_rows=self.kv.kv_rows.name)

    def _index(self, cache: str, slot: int) -> int:
        """Slot `slot` of `cache` as a sequence of `kv`."""
        return slot if cache == "batch" else self.batch_slots + slot

    def warmup(self) -> None:
        """Run the model once (first calls pay one-off initialisation), then clear the batch cache.
        Calls the model directly, not through `prefill`/`step`, so no fault point is counted."""
        scratch = self.batch.narrow(1)
        try:
            with torch.no_grad():
                ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
                self.model(ids, cache=scratch)
                self.model(ids[:, :1], cache=scratch)
        except BaseException as e:  # noqa: BLE001
            log.warning("engine: warm-up failed: %s: %s", type(e).__name__, e)
        finally:
            self.batch.reset()

    def prefill(self, slot: int, piece: list[int], full_logits: bool):
        """Feed `piece` into resident slot `slot` as one chunk: (the last token's logits [V], every
        token's logits [len(piece), V] when `full_logits`, else None)."""
        ids = torch.tensor([piece], dtype=torch.long, device=self.device)
        every = []
        on_chunk = (lambda n, chunk_logits: every.append(chunk_logits[0])) if full_logits else None
        cache = self.resident.slot(slot)
        if self.speculator is None:
            logits = prefill(self.model, cache, ids, len(piece), full_logits=full_logits, on_chunk=on_chunk)
        else:  # the MTP layer is fed too, from where the slot's last chunk left it
            carry = self._carry(slot)
            self.carry.pop(slot, None)
            logits, streams = prefill(self.model, cache, ids, len(piece), full_logits=full_logits,
                                      on_chunk=on_chunk, mtp=True, carry=carry)
            self.carry[slot] = (int(cache.positions[0]), streams)
        return logits[0].clone(), (every[0] if every else None)

    def _carry(self, slot: int) -> torch.Tensor | None:
        """The streams a prefill of resident slot `slot` left, if the slot still holds that sequence."""
        held = self.carry.get(slot)
        return held[1] if held is not None and held[0] == int(self.resident.positions[slot]) else None

    def _changed(self, cache: str, slot: int | None) -> None:
        if cache == "resident":
            if slot is None:
                self.carry.clear()
            else:
                self.carry.pop(slot, None)

    def decode(self, ids: list[int]) -> torch.Tensor:
        """One decode step of batch slots 0..len(ids)-1, each fed its token: logits [len(ids), V]."""
        return self.decoder.step(torch.tensor(ids, dtype=torch.long, device=self.device))

    def copy(self, dst_cache: str, dst: int, src: int, src_cache: str) -> None:
        """Copy sequence `src` of cache `src_cache` into slot `dst` of cache `dst_cache`."""
        self.kv.fork(self._index(dst_cache, dst), self._index(src_cache, src))  # its blocks shared, not copied
        carry = self.carry.get(src) if src_cache == "resident" else None
        self._changed(dst_cache, dst)
        if carry is not None and dst_cache == "resident":
            self.carry[dst] = carry

    def reset(self, cache: str, slot: int | None = None) -> None:
        """Forget slot `slot` of `cache` (every slot when None)."""
        getattr(self, cache).reset(slot)
        self._changed(cache, slot)

    def import_sequence(self, slot: int, state: dict) -> None:
        """Resident slot `slot` continues from `state` (another rank's `export_sequence`)."""
        self.resident.import_sequence(slot, state)
        self._changed("resident", slot)

    def take_checkpoint(self, checkpoint_id, cache: str, slot: int) -> None:
        """Checkpoint slot `slot` of `cache` as `checkpoint_id` (replacing one of that id)."""
        self.checkpoints[checkpoint_id] = getattr(self, cache).take_checkpoint(slot)

    def restore_checkpoint(self, cache: str, slot: int, checkpoint_id) -> None:
        """Rewind slot `slot` of `cache` in place to checkpoint `checkpoint_id`."""
        getattr(self, cache).restore_checkpoint(slot, self._checkpoint(checkpoint_id))
        self._changed(cache, slot)

    def branch_from_checkpoint(self, dst_cache: str, dst: int, src_cache: str, src: int, checkpoint_id) -> None:
        """Slot `dst` of `dst_cache` continues from checkpoint `checkpoint_id`, with the compressed
        rows of sequence `src` of `src_cache` (which is left as it is)."""
        self.kv.branch_from_checkpoint(self._index(dst_cache, dst), self._index(src_cache, src),
                                       self._checkpoint(checkpoint_id))
        self._changed(dst_cache, dst)

    def import_checkpoint(self, checkpoint_id, checkpoint: dict) -> None:
        """Hold `checkpoint` (read from disk by rank 0, sent to every rank, without logits) as
        `checkpoint_id`, checked first and copied to this rank's device."""
        self.checkpoints[checkpoint_id] = self.resident.import_checkpoint(checkpoint)

    def drop_checkpoint(self, checkpoint_id) -> None:
        """Forget checkpoint `checkpoint_id` (unknown ids are ignored)."""
        self.checkpoints.pop(checkpoint_id, None)

    def checkpoint_bytes(self) -> int:
        """Bytes of every checkpoint held (on one rank)."""
        return sum(t.numel() * t.element_size() for c in self.checkpoints.values() for t in c.values())

    def _checkpoint(self, checkpoint_id) -> dict:
        checkpoint = self.checkpoints.get(checkpoint_id)
        if checkpoint is None:
            raise KeyError(f"no checkpoint {checkpoint_id!r} in this replica")
        return checkpoint

    def reset_batch(self) -> str | None:
        """Drop the batch's device state: captured graphs, batch slots (their blocks released),
        cached allocations. Returns None, or why even that failed (the batch slots are views of
        the pool every resident session uses: they cannot be reallocated alone)."""
        try:
            self.decoder.reset()
            self.batch.reset()
            if self.speculator is not None:
                self.speculator.reset()
            self.release_allocator()
        except BaseException as e:  # noqa: BLE001 - the device is gone: the engine reports it degraded
            log.error("engine: reset failed: %s", e)
            return f"cannot reset the KV cache: {e}"
        return None

    # ------------------------------------------------------------------ the sampler's writes
    def sampler_admit(self, slot: int, params: SamplingParams, prompt_ids, generated, eos_ids) -> None:
        """A request's settings into sampler slot `slot`; the tokens it sent already count (a retry)."""
        self.sampler.admit(slot, params, prompt_ids, generated, eos_ids)

    def sampler_move(self, dst: int, src: int) -> None:
        """Batch slot `src`'s request moved to `dst`: its settings, and its speculation state."""
        self.sampler.move(dst, src)
        if self.speculator is not None:
            self.speculator.move_row(dst, src)

    def sampler_release(self, slot: int) -> None:
        self.sampler.release(slot)

    def sampler_append(self, tokens: list[int], slots: list[int] | None) -> None:
        """The tokens the rows took: the penalties' history, min_tokens and the noise position move on."""
        self.sampler.append(torch.tensor(tokens, dtype=torch.long), slots)

    # ------------------------------------------------------------------ speculative decoding
    def join(self, slot: int, first: int, resident_slot: int | None) -> None:
        """Batch slot `slot` (copied from resident slot `resident_slot`, or None: it was decoding
        without speculation) starts speculating after `first`, its pending token: the first draft
        comes from the prefill's last streams when the resident slot still has them."""
        carry = None if resident_slot is None else self._carry(resident_slot)
        self.speculator.join_row(slot, first, carry)

    def speculate(self, limits: list[int], allowed: torch.Tensor | None, logprobs: int | None) -> list:
        """One speculative step of batch slots 0..len(limits)-1 (`Speculator.step_batch`, detailed,
        the caller records the tokens): per slot (tokens, their fp32 logits [k, V], failed, their
        logprobs, their top (ids, logprobs) lists, the drafts it could have taken), logprobs when
        `logprobs` k is given."""
        spec = self.speculator
        tokens, rows = spec.step_batch(limits, allowed, logprobs, detailed=True, record=False)
        failed, T = set(spec.failed_rows), spec.last[1].T
        out = spec.last_sample
        lp = ids = tops = None
        if logprobs is not None:
            lp, ids, tops = out.logprob.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()
        result = []
        for b, got in enumerate(tokens):
            at = range(b * T, b * T + len(got))
            result.append((got, rows[b], b in failed, None if lp is None else [lp[i] for i in at],
                           None if lp is None else [(ids[i], tops[i]) for i in at], min(T - 1, limits[b] - 1)))
        return result

    def trim(self, used: list) -> None:
        """Slots whose request took fewer of the last step's tokens give the rest back (`Speculator.trim`)."""
        self.speculator.trim(used)

    def set_pending(self, slot: int, token: int) -> None:
        """Batch slot `slot` feeds `token` next (its grammar closed the value with another token)."""
        self.speculator.pending[slot] = token

    def release_allocator(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def heartbeat(self) -> None:
        """Nothing: rank 0 sends it while idle, so the other ranks' waits stay short."""
