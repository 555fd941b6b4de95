"""One process's model and KV caches, and every operation the engine runs on them.

The engine (serve.engine) decides; a `Replica` executes. Every call that touches the model or a
cache is a method here taking plain, picklable arguments (slot numbers, token id lists, cache
names), so that under tensor parallelism rank 0 can send each call to the other ranks before
running it (serve.tp): every rank holds a `Replica` of the same shape and runs the same calls in
the same order, which is what keeps their collectives matched and their caches (replicated per
rank) equal. In a single process the engine calls its replica directly.

Cache names: "resident" (one conversation per slot, kept between requests) and "batch" (the
sequences decoding together).

Checkpoints (`DS4Cache.take_checkpoint`) live in the replica, under ids the engine chooses, so
each rank holds its own copy, on its own device: taking, restoring, branching from, importing and
dropping one are replica operations like the others (cache operations: they run no collective).
"""
from __future__ import annotations

import logging

import torch

from ds4_torch.decode import make_decoder, prefill

log = logging.getLogger("ds4.serve")

# The operations that run the model: under tensor parallelism each is a series of collectives,
# which cannot run once the group is broken (cache copies and resets are local).
MODEL_OPERATIONS = frozenset({"warmup", "prefill", "decode"})


class Replica:
    def __init__(self, model, *, ctx: int, sessions: int, batch_slots: int, decode_mode: str):
        self.model, self.ctx, self.decode_mode = model, ctx, decode_mode
        self.device = model.device
        self.resident = model.new_cache(batch_size=sessions, max_context=ctx)
        self.batch = model.new_cache(batch_size=batch_slots, max_context=ctx)
        self.decoder = make_decoder(model, self.batch, decode_mode, scratch_padding=True)
        self.checkpoints: dict = {}  # checkpoint id -> `DS4Cache.take_checkpoint` (no logits: rank 0 keeps those)

    def shape(self) -> dict:
        """The constructor's arguments (besides the model): another rank builds the same replica."""
        return dict(ctx=self.ctx, sessions=self.resident.batch_size, batch_slots=self.batch.batch_size,
                    decode_mode=self.decode_mode)

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
        logits = prefill(self.model, self.resident.slot(slot), ids, len(piece), full_logits=full_logits,
                         on_chunk=(lambda n, chunk_logits: every.append(chunk_logits[0])) if full_logits else None)
        return logits[0].clone(), (every[0] if every else None)

    def decode(self, ids: list[int]) -> torch.Tensor:
        """One decode step of batch slots 0..len(ids)-1, each fed its token: logits [len(ids), V]."""
        return self.decoder.step(torch.tensor(ids, dtype=torch.long, device=self.device))

    def copy(self, dst_cache: str, dst: int, src: int, src_cache: str) -> None:
        """Copy sequence `src` of cache `src_cache` into slot `dst` of cache `dst_cache`."""
        target = getattr(self, dst_cache)
        target.copy_sequence(dst, src, None if src_cache == dst_cache else getattr(self, src_cache))

    def reset(self, cache: str, slot: int | None = None) -> None:
        """Forget slot `slot` of `cache` (every slot when None)."""
        getattr(self, cache).reset(slot)

    def import_sequence(self, slot: int, state: dict) -> None:
        """Resident slot `slot` continues from `state` (another rank's `export_sequence`)."""
        self.resident.import_sequence(slot, state)

    def take_checkpoint(self, checkpoint_id, cache: str, slot: int) -> None:
        """Checkpoint slot `slot` of `cache` as `checkpoint_id` (replacing one of that id)."""
        self.checkpoints[checkpoint_id] = getattr(self, cache).take_checkpoint(slot)

    def restore_checkpoint(self, cache: str, slot: int, checkpoint_id) -> None:
        """Rewind slot `slot` of `cache` in place to checkpoint `checkpoint_id`."""
        getattr(self, cache).restore_checkpoint(slot, self._checkpoint(checkpoint_id))

    def branch_from_checkpoint(self, dst_cache: str, dst: int, src_cache: str, src: int, checkpoint_id) -> None:
        """Slot `dst` of `dst_cache` continues from checkpoint `checkpoint_id`, with the compressed
        rows of sequence `src` of `src_cache` (which is left as it is)."""
        target = getattr(self, dst_cache)
        target.branch_from_checkpoint(dst, src, self._checkpoint(checkpoint_id),
                                      None if src_cache == dst_cache else getattr(self, src_cache))

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
        """Drop the batch's device state: captured graphs, batch cache contents, cached
        allocations. Returns None, or why the batch cache could not even be reallocated."""
        try:
            self.decoder.reset()
            self.batch.reset()
            self.release_allocator()
        except BaseException as e:  # noqa: BLE001 - the reset itself failed: reallocate
            log.error("engine: reset failed (%s); reallocating the batch cache", e)
            try:
                self.batch = self.model.new_cache(batch_size=self.batch.batch_size, max_context=self.ctx)
                self.decoder = make_decoder(self.model, self.batch, self.decode_mode, scratch_padding=True)
            except BaseException as e2:  # noqa: BLE001
                log.error("engine: cannot reallocate the batch cache: %s", e2)
                return f"cannot reallocate the KV cache: {e2}"
        return None

    def release_allocator(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def heartbeat(self) -> None:
        """Nothing: rank 0 sends it while idle, so the other ranks' waits stay short."""
