"""Paged compressed KV: the bookkeeping of a block pool and of one block table per sequence.

Compressed rows (CSA, indexer, HCA) are append-only and causal: the rows of tokens
[k*bt, (k+1)*bt) are fully determined by the tokens up to (k+1)*bt. So the cache can be cut
into blocks of `block_tokens` (bt) tokens of context, and a block that is full can be shared by
every sequence with the same first (k+1)*bt tokens. A block of bt tokens holds bt / m rows of
each layer of rate m (V4-Flash, bt = 256: 64 CSA rows and 64 indexer rows, 2 HCA rows), so bt
must be a multiple of every rate. The window ring and the open windows are not paged: they stay
per running sequence and in checkpoints (`DS4Cache.take_checkpoint`), which is what keeps reuse
exact at any divergence point.

`BlockPool` and `BlockTable` hold no tensors: they say which physical block holds which rows and
when a block's rows must be copied. `PagedDS4Cache` is the tensor side: a `DS4Cache` whose rows
live in one pool of `num_blocks` blocks per layer and state, read and written through the tables.

- `BlockPool`: `num_blocks` physical blocks. Each has a reference count (how many block tables
  hold it). A full block can be *registered* under its chain digest (`chain_digest`: the tenant,
  the digest of the blocks before it and its own tokens), so `lookup` finds the longest chain of
  cached full blocks of a token sequence. A registered block nobody holds stays cached (its rows
  are kept) in least-recently-released order; it is reclaimed only when no free block is left.
  Free blocks are handed out lowest id first (deterministic). A block is writable only when one
  table holds it and it is not registered (registered rows are immutable); otherwise a write
  first copies it (copy on write). Its `listener` (`PoolListener`, optional) is told of every
  digest registered and every one dropped, as it happens (what `serve --kv-events` publishes).
- `BlockTable`: one sequence's blocks in order, its tokens, and the digests of its full blocks.
  `append` returns the block copies the caller must make before writing rows (`tentative`: a
  speculative step's, registered only once final); `drop` gives back a rolled-back tail; `fork`
  shares every block; `truncate` rewinds; `free` releases.
- `PagedDS4Cache`: see its docstring. Two sequences sharing a prompt's rows:

      cache = PagedDS4Cache(model.config, batch_size=2, max_context=8192)  # blocks of 256 tokens
      first = cache.slot(0)              # sequence 0 alone (a view sharing the pool)
      first.append_tokens(prompt)        # prompt: [1, T] token ids; the blocks they reach
      model(prompt, first)               # prefill; its full blocks are cached under their digests
      cache.fork(1, 0)                   # sequence 1 continues from there: blocks shared, not copied
      nxt = torch.tensor([[a], [b]])     # the two diverge; the shared partial block is copied once
      cache.append_tokens(nxt)
      logits = model(nxt, cache)

Tenants: digests start from the tenant, so two tenants never share a block (a digest of
tenant A's tokens can never equal tenant B's). Releasing a table releases its last block first,
so under pressure the tail of a cached chain goes before its head (a chain is only usable from
its first block).
"""
from __future__ import annotations

import hashlib
import heapq
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import torch

from .cache import CompressorState, DS4Cache, _compressor_state, _flat_bytes
from .config import DS4Config

__all__ = ["PoolExhausted", "chain_digest", "block_nbytes", "pool_blocks", "PoolListener", "BlockPool", "BlockTable",
           "PagedDS4Cache"]

DEFAULT_BLOCK_TOKENS = 256


class PoolExhausted(RuntimeError):
    """No free or reclaimable block is left for an allocation; nothing was changed."""


def chain_digest(parent: bytes | None, tenant: str | None, tokens: Sequence[int]) -> bytes:
    """The 16-byte digest of a full block: of its parent's digest (None for a sequence's first
    block, whose digest starts from `tenant` instead) and its token ids (int64, little endian)."""
    h = hashlib.blake2b(digest_size=16)
    if parent is None:
        h.update(b"root\0" + (b"\1" + tenant.encode() if tenant is not None else b"\0"))
    else:
        h.update(b"block\0" + parent)
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


def block_nbytes(config: DS4Config, dtype: torch.dtype, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 kv_rows: str = "full") -> int:
    """Bytes one block of `block_tokens` tokens takes in a `PagedDS4Cache` of `config` (every
    layer's compressed and indexer rows; the `block_nbytes` of a real one): what a pool of a
    given size in bytes is divided by."""
    from .footprint import layer_bytes_per_token

    return round(block_tokens * sum(layer_bytes_per_token(config, kv_rows, dtype)))


def pool_blocks(config: DS4Config, dtype: torch.dtype, memory_bytes: float, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                kv_rows: str = "full") -> int:
    """Blocks of a pool of `memory_bytes`."""
    return int(memory_bytes // block_nbytes(config, dtype, block_tokens, kv_rows))


class PoolListener(Protocol):
    """What a `BlockPool`'s `listener` is told, on the thread changing the pool (so it must be quick
    and never raise): a full block was registered under `digest` (`stored`: the digest of the block
    before it in its sequence, None for a sequence's first block; its token ids; its tenant), or
    the block registered under `digest` was reclaimed or unregistered (`removed`). At any moment
    the digests stored and not removed are exactly the pool's registered ones."""

    def stored(self, digest: bytes, parent: bytes | None, tokens: Sequence[int], tenant: str | None) -> None: ...

    def removed(self, digest: bytes) -> None: ...


class BlockPool:
    """`num_blocks` blocks of `block_tokens` tokens: reference counts, a free list, and full
    blocks cached under their chain digest (see the module docstring)."""

    def __init__(self, num_blocks: int, block_tokens: int = DEFAULT_BLOCK_TOKENS):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens must be a positive integer, got {block_tokens!r}")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self._refcounts = [0] * num_blocks
        self._free = list(range(num_blocks))  # a heap: lowest id first
        self._digest_of: dict[int, bytes] = {}      # registered block -> digest
        self._block_of: dict[bytes, int] = {}       # digest -> registered block
        self._cached: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced; oldest first
        self.evictions = 0  # cached blocks reclaimed so far
        self.num_shared = 0  # blocks held by more than one table (kept as counts change: a gauge reads it)
        self.peak_used = 0   # the most blocks held at once (`num_used`) so far
        self.listener: PoolListener | None = None

    # ------------------------------------------------------------------ state
    def refcount(self, block: int) -> int:
        return self._refcounts[block]

    def digest(self, block: int) -> bytes | None:
        """The digest `block` is registered under, or None."""
        return self._digest_of.get(block)

    @property
    def num_free(self) -> int:
        """Blocks holding nothing."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Registered blocks no table holds: kept for reuse, reclaimed when nothing is free."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks some table holds."""
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can still get (free, then reclaimed)."""
        return len(self._free) + len(self._cached)

    def free_blocks(self) -> list[int]:
        return sorted(self._free)

    def cached_blocks(self) -> list[int]:
        """Unreferenced cached blocks in reclaim order (first reclaimed first)."""
        return list(self._cached)

    def writable(self, block: int) -> bool:
        """Whether one holder may write `block`'s rows in place."""
        return self._refcounts[block] == 1 and block not in self._digest_of

    # ------------------------------------------------------------------ alloc
    def allocate(self) -> int:
        """A block held once: the lowest free one, else the least recently released cached
        one (unregistered). PoolExhausted when neither exists."""
        if self._free:
            block = heapq.heappop(self._free)
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            self._unregister(block)
            self.evictions += 1
        else:
            raise PoolExhausted(f"all {self.num_blocks} KV blocks of {self.block_tokens} tokens are in use")
        self._refcounts[block] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return block

    def incref(self, block: int) -> None:
        if self._refcounts[block] == 0:
            if block not in self._cached:
                raise ValueError(f"block {block} is free: allocate it instead")
            del self._cached[block]  # reused: no longer a reclaim candidate
            self.peak_used = max(self.peak_used, self.num_used)
        self._refcounts[block] += 1
        if self._refcounts[block] == 2:
            self.num_shared += 1

    def decref(self, block: int) -> None:
        count = self._refcounts[block]
        if count <= 0:
            raise ValueError(f"block {block} is not held")
        self._refcounts[block] = count - 1
        if count == 2:
            self.num_shared -= 1
        if count == 1:
            if block in self._digest_of:
                self._cached[block] = None  # the most recently released: reclaimed last
            else:
                heapq.heappush(self._free, block)

    def register(self, block: int, digest: bytes, parent: bytes | None = None, tokens: Sequence[int] = (),
                 tenant: str | None = None) -> bool:
        """Cache held, full `block` under `digest` (`parent`, `tokens`, `tenant`: what `digest`
        was computed from, for the listener). False (and nothing changes) when another block
        already holds that digest: `block` stays a private copy."""
        if self._refcounts[block] <= 0:
            raise ValueError(f"block {block} is not held")
        if digest in self._block_of or block in self._digest_of:
            return False
        self._block_of[digest] = block
        self._digest_of[block] = digest
        if self.listener is not None:
            self.listener.stored(digest, parent, tokens, tenant)
        return True

    def _unregister(self, block: int) -> None:
        """`block`'s digest is no longer cached (the listener is told)."""
        digest = self._digest_of.pop(block)
        del self._block_of[digest]
        if self.listener is not None:
            self.listener.removed(digest)

    def blocks_needed(self, tables: Sequence["BlockTable"], new_tokens: Sequence[int]) -> int:
        """Blocks appending new_tokens[i] tokens to tables[i], one table after the other, would
        allocate: the blocks they grow into, plus a copy for each write into a block that is
        registered or held elsewhere. A held block several of these tables write into is copied
        by all of them but the last, which then holds it alone (unless it is registered or held
        by a table outside `tables`)."""
        grow, writers = 0, {}
        for table, t in zip(tables, new_tokens):
            if t <= 0:
                continue
            n = len(table.tokens)
            grow += math.ceil((n + t) / self.block_tokens) - len(table.blocks)
            if n < len(table.blocks) * self.block_tokens:  # the new rows start inside a held block
                block = table.blocks[n // self.block_tokens]
                writers[block] = writers.get(block, 0) + 1
        copies = sum(c if block in self._digest_of or self._refcounts[block] > c else c - 1
                     for block, c in writers.items())
        return grow + copies

    def lookup(self, tokens: Sequence[int], tenant: str | None = None) -> list[int]:
        """The blocks of the longest chain of cached full blocks that starts `tokens` (of
        `tenant`). Takes no reference: `BlockTable.from_prefix` does."""
        bt, out, parent = self.block_tokens, [], None
        for k in range(len(tokens) // bt):
            parent = chain_digest(parent, tenant, tokens[k * bt:(k + 1) * bt])
            block = self._block_of.get(parent)
            if block is None:
                break
            out.append(block)
        return out


class BlockTable:
    """One sequence's blocks: `blocks[k]` holds its tokens [k*bt, (k+1)*bt) (the rows of rate m
    [k*bt/m, (k+1)*bt/m)); `tokens` the token ids so far (None where unknown: an imported state's
    without its tokens, or a speculative step's until it is settled); `digests[k]` the chain
    digest of full block k, for the full blocks registered (or offered: another block may hold
    that digest already) so far.

    A block is registered only once its tokens are final: an `append` registers the blocks it
    fills, a `tentative` one (a speculative verify step, whose tokens a `Rollback` may take back
    and whose rows it then clears) only those filled before it; `commit` registers the rest. A
    block holding an unknown token id is never registered, nor is any after it (a digest covers
    every token before it)."""

    def __init__(self, pool: BlockPool, tenant: str | None = None):
        self.pool = pool
        self.tenant = tenant
        self.blocks: list[int] = []
        self.tokens: list[int] = []
        self.digests: list[bytes] = []

    @classmethod
    def from_prefix(cls, pool: BlockPool, tokens: Sequence[int], tenant: str | None = None) -> "BlockTable":
        """A table holding the cached blocks of the longest cached prefix of `tokens` (whole
        blocks; `num_tokens` says how many tokens that covers). The caller computes the rest
        from a checkpoint at `num_tokens` (or from 0) and `append`s it."""
        table = cls(pool, tenant)
        for block in pool.lookup(tokens, tenant):
            pool.incref(block)
            table.blocks.append(block)
            table.digests.append(pool.digest(block))
        table.tokens = list(tokens[:len(table.blocks) * pool.block_tokens])
        return table

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def blocks_needed(self, new_tokens: int) -> int:
        """Blocks `append` of `new_tokens` tokens would allocate (a copy on write included)."""
        return self.pool.blocks_needed([self], [new_tokens])

    def append(self, tokens: Sequence[int | None], tentative: bool = False) -> list[tuple[int, int]]:
        """Extend by `tokens` (None: an id not known yet): allocate the blocks they reach, copy a
        shared or registered block they write into, register the blocks whose tokens are final
        (see the class docstring). Returns the (source, destination) copies to make, in order,
        before writing the new rows. PoolExhausted (nothing changed) when the pool cannot supply
        the blocks."""
        pool, bt = self.pool, self.pool.block_tokens
        need = self.blocks_needed(len(tokens))
        if need > pool.num_available:
            raise PoolExhausted(f"{len(tokens)} more tokens need {need} KV blocks, {pool.num_available} "
                                f"of {pool.num_blocks} are available")
        n = len(self.tokens)
        copies = self._own_block(n // bt) if tokens else []
        self.tokens.extend(None if t is None else int(t) for t in tokens)
        while len(self.blocks) * bt < len(self.tokens):
            self.blocks.append(pool.allocate())
        self._register((n if tentative else len(self.tokens)) // bt)
        return copies

    def _own_block(self, k: int) -> list[tuple[int, int]]:
        """Make held block k (if any) this table's alone and unregistered, so its rows may be
        written: a copy of it when it is shared or registered. Returns the copy to make."""
        if k >= len(self.blocks) or self.pool.writable(self.blocks[k]):
            return []
        new = self.pool.allocate()
        self.pool.decref(self.blocks[k])
        old, self.blocks[k] = self.blocks[k], new
        return [(old, new)]

    def _register(self, full: int) -> None:
        """Register blocks [len(digests), full), stopping at one holding an unknown token id."""
        bt = self.pool.block_tokens
        for k in range(len(self.digests), full):
            tokens = self.tokens[k * bt:(k + 1) * bt]
            if None in tokens:
                return
            parent = self.digests[-1] if self.digests else None
            self.digests.append(chain_digest(parent, self.tenant, tokens))
            self.pool.register(self.blocks[k], self.digests[k], parent, tokens, self.tenant)

    def commit(self) -> None:
        """The tokens are final (no `Rollback` will take any back): register every full block."""
        self._register(len(self.tokens) // self.pool.block_tokens)

    def name_tokens(self, ids: Sequence[int]) -> None:
        """The last len(ids) tokens, appended with unknown ids (a tentative append), are `ids`."""
        start = len(self.tokens) - len(ids)
        if start < 0 or any(t is not None and t != int(i) for t, i in zip(self.tokens[start:], ids)):
            raise ValueError(f"cannot name the last {len(ids)} of {len(self.tokens)} tokens {list(ids)[:8]}: "
                             f"they are {self.tokens[start:][:8]}")
        self.tokens[start:] = [int(i) for i in ids]

    def drop(self, n: int) -> list[tuple[int, int]]:
        """Give back the last `n` tokens (a `Rollback` took them back) and make the block the
        kept ones end in this table's own, since the rollback clears the rows the dropped tokens
        closed there. Returns the copy to make first (as `append`); PoolExhausted (nothing
        changed) when that copy finds no block even once the dropped blocks are released."""
        keep = len(self.tokens) - n
        if not 0 <= keep <= len(self.tokens):
            raise ValueError(f"cannot drop {n} of {len(self.tokens)} tokens")
        k, bt = keep // self.pool.block_tokens, self.pool.block_tokens
        released = sum(1 for b in self.blocks[math.ceil(keep / bt):] if self.pool.refcount(b) == 1)
        if keep % bt and not self.pool.writable(self.blocks[k]) and self.pool.num_available + released < 1:
            raise PoolExhausted(f"giving back {n} tokens needs a copy of a shared KV block; none is available")
        self.truncate(keep)
        return self._own_block(k) if keep % bt else []

    def fork(self) -> "BlockTable":
        """A table sharing every block of this one (no copy): the first write into a shared
        partial block copies it."""
        other = BlockTable(self.pool, self.tenant)
        for block in self.blocks:
            self.pool.incref(block)
        other.blocks, other.tokens, other.digests = list(self.blocks), list(self.tokens), list(self.digests)
        return other

    def truncate(self, n: int) -> None:
        """Keep the first `n` tokens (a rewind): release the blocks past them. A kept last block
        that was registered stays so (its first rows are still right); the next write copies it."""
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"cannot truncate a sequence of {len(self.tokens)} tokens to {n}")
        keep = math.ceil(n / self.pool.block_tokens)
        for block in reversed(self.blocks[keep:]):
            self.pool.decref(block)
        del self.blocks[keep:], self.tokens[n:], self.digests[n // self.pool.block_tokens:]

    def free(self) -> None:
        """Release every block (the last first: a cached chain loses its tail before its head)."""
        self.truncate(0)

    def __repr__(self) -> str:
        return f"BlockTable(tenant={self.tenant!r}, tokens={len(self.tokens)}, blocks={self.blocks})"


# --------------------------------------------------------------------------- the paged cache
class PagedDS4Cache(DS4Cache):
    """A `DS4Cache` whose compressed and indexer rows live in blocks of one `BlockPool` shared by
    its sequences (`pool`), one `BlockTable` per sequence (`tables`). Per layer and state, each
    row part (`CompressorState.row_parts`: `rows`, and for fp8 rows their scales and kept RoPE
    channels) is a pool [num_blocks * bt / m + 1, width] (the last row a scratch row) and `slots`
    [B, C+1] int64 the pool row of each sequence's row w, rebuilt in place from the tables (a
    captured graph, which reads them as inputs, sees a sequence's new blocks); the model writes
    through it (`CompressorState.write_rows`) and hands the attention and top-k ops the pool and
    slots (`CompressorState.kernel_rows`: the Triton kernels read the rows in place, the
    reference gathers them; fp8 rows are gathered, dequantized, by `visible`), so its logits are
    the static cache's, bit for bit. The window ring, open windows and positions stay per
    sequence, as in `DS4Cache` (checkpoints take them as usual).

    Every forward takes its tokens first (`take_tokens`, called by the model's forward, `prefill`
    and the decoders; or `append_tokens(ids)` by the caller): each sequence gets the blocks its
    new tokens reach, for the whole batch or not at all (`blocks_needed` says how many beforehand).
    Sharing: `fork` / `copy_sequence` (continue another sequence's state, no copy),
    `branch_from_checkpoint` (another sequence's blocks up to a checkpoint's position),
    `start_from_cache` (the pool's cached blocks of a prefix, plus a checkpoint at their end); the
    other sequence may be in a view of the same cache (`_view`, `narrow`, `slot`: they share the
    pool, and such operations run on the whole cache by global index). From a static cache or
    another pool the rows are copied (`export_sequence` / `import_sequence`).

    Speculation (`cache.Rollback`): the verify forward takes its tokens tentatively (their ids
    stay on the device and the blocks they fill are not registered), `Rollback.apply` takes
    rejected ones back on the device, then `drop_tokens` / `name_tokens` settle the tables on the
    host (`speculative.Speculator` does all of it).

    `num_blocks` defaults to a pool for `batch_size` sequences of `max_context` tokens. The MTP
    layers' state stays a static `DS4Cache` (`mtp`)."""

    def __init__(self, config: DS4Config, batch_size: int = 1, max_context: int = 4096,
                 dtype: torch.dtype = torch.float32, device=None, kv_rows: str = "full",
                 num_blocks: int | None = None, block_tokens: int = DEFAULT_BLOCK_TOKENS):
        rates = sorted({config.compress_rate(i) for i in range(config.num_hidden_layers)} - {0})
        bad = [m for m in rates if block_tokens % m]
        if bad:
            raise ValueError(f"block_tokens {block_tokens} is not a multiple of the compression rates {bad}")
        if num_blocks is None:
            num_blocks = batch_size * math.ceil(max_context / block_tokens)
        self.pool = BlockPool(num_blocks, block_tokens)
        self.all_tables = [BlockTable(self.pool) for _ in range(batch_size)]  # (views index it from _offset)
        self._slots: dict[int, torch.Tensor] = {}  # rate -> [B, C+1], shared by that rate's states
        self._mapped = [[] for _ in range(batch_size)]  # the blocks each sequence's slots map (views share it)
        super().__init__(config, batch_size, max_context, dtype, device, kv_rows)
        self._root = self  # views keep it: what spans views runs here, by global index

    def _compressor_state(self, capacity, rate, dim, overlap, fp8_rope_kept) -> CompressorState:
        per_block = self.pool.block_tokens // rate
        scratch = self.pool.num_blocks * per_block
        state = _compressor_state(self.batch_size, 0, rate, dim, overlap, self.dtype, self.device, fp8_rope_kept)
        state.allocate_rows(scratch + 1)
        if rate not in self._slots:
            self._slots[rate] = torch.full((self.batch_size, capacity + 1), scratch, dtype=torch.long,
                                           device=self.device)
        state.slots = self._slots[rate]
        return state

    def tensors(self) -> list[torch.Tensor]:
        """The state's tensors (the pools', every sequence's own state), the slot maps last: graph
        inputs, read in place at every replay (and counted by `nbytes`)."""
        return super().tensors() + list(self._slots.values())

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across every layer's pools (its compressed and indexer rows)."""
        rows = sum(t[:-1].numel() * t.element_size() for layer in self.layers for s in layer.states
                   for t in s.row_parts().values())  # (fp8 rows: their scales and kept RoPE channels too)
        return rows // self.pool.num_blocks

    def table(self, index: int) -> BlockTable:
        """Sequence `index`'s block table."""
        return self.all_tables[self._offset + index]

    @property
    def tables(self) -> list[BlockTable]:
        """Every sequence's block table, in order."""
        return [self.table(b) for b in range(self.batch_size)]

    # ------------------------------------------------------------------ tables -> slots
    def _refresh(self, indices) -> None:
        """Bring the slots of sequences `indices` up to their tables: only the rows of blocks that
        changed since the last refresh are written (a decode step that stays in its last block
        writes none)."""
        for b in indices:
            blocks, mapped = self.table(b).blocks, self._mapped[self._offset + b]
            first = next((k for k, (x, y) in enumerate(zip(blocks, mapped)) if x != y), min(len(blocks), len(mapped)))
            end = max(len(blocks), len(mapped))
            if first == end:
                continue
            held = torch.tensor(blocks[first:] + [0], dtype=torch.long)  # (+1: never empty)
            for rate, slots in self._slots.items():
                per_block, C = self.pool.block_tokens // rate, slots.shape[1] - 1
                lo, hi = min(first * per_block, C), min(end * per_block, C)
                if lo == hi:
                    continue
                w = torch.arange(lo, hi, dtype=torch.long)
                k = w // per_block - first
                row = torch.where(k < len(blocks) - first, held[k.clamp(max=len(held) - 1)] * per_block + w % per_block,
                                  self.pool.num_blocks * per_block)  # (past the table: the scratch row)
                slots[b, lo:hi] = row.to(slots.device)
            mapped[:] = blocks

    def _copy_blocks(self, copies) -> None:
        """Copy whole blocks (source, destination) in every pool: a copy on write."""
        if not copies:  # (most appends)
            return
        for layer in self.layers:
            for state in layer.states:
                per_block = self.pool.block_tokens // layer.rate
                for rows in state.row_parts().values():
                    blocks = rows[:-1].view(-1, per_block, rows.shape[-1])  # (less the scratch row)
                    for src, dst in copies:
                        blocks[dst] = blocks[src]

    def blocks_needed(self, new_tokens, n: int | None = None) -> int:
        """Blocks a forward of `new_tokens` tokens (an int, or one count per sequence) over the
        first `n` sequences (default: all) would take from the pool, copies of shared blocks
        included, exactly as `append_tokens` takes them: a forward fits while this is at most
        `pool.num_available`. (A speculative step over r rows runs the next power of two of rows
        in graph or compile mode, every one of them taking 1 + N tokens for the step.)"""
        end = self.batch_size if n is None else n
        counts = [new_tokens] * end if isinstance(new_tokens, int) else list(new_tokens)
        if len(counts) != end:
            raise ValueError(f"{len(counts)} token counts for {end} sequences")
        return self.pool.blocks_needed([self.table(b) for b in range(end)], counts)

    def append_tokens(self, input_ids: torch.Tensor, tentative: bool = False) -> None:
        """Before a forward of `input_ids` [B, T]: every sequence's table takes its T tokens
        (blocks allocated, shared blocks it writes copied). PoolExhausted, with every table
        unchanged, when the pool cannot supply the whole batch's blocks: free or preempt and
        retry. `tentative`: a speculative verify step's tokens, which a `Rollback` may take back:
        their ids are not read (they stay on the device; `name_tokens` gives the kept ones) and
        the blocks they fill are registered only once final (`BlockTable`)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != self.batch_size:
            raise ValueError(f"input_ids must be [{self.batch_size}, tokens], got {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        need, available = self.blocks_needed(T), self.pool.num_available
        if need > available:
            raise PoolExhausted(f"{T} more tokens for {B} sequences need {need} KV blocks, {available} of "
                                f"{self.pool.num_blocks} are available")
        rows = [[None] * T for _ in range(B)] if tentative else input_ids.tolist()
        for b, row in enumerate(rows):
            self._copy_blocks(self.table(b).append(row, tentative))
        self._refresh(range(B))

    def take_tokens(self, input_ids: torch.Tensor, tentative: bool = False) -> None:
        """Before a forward of `input_ids` [B, T] (the model's forward, the decoders and `prefill`
        call it): `append_tokens` unless the caller already did. `tentative` (a speculative
        verify step): always appends, reading nothing from the device (the tables are trusted
        to hold the positions)."""
        if tentative:
            self.append_tokens(input_ids, tentative=True)
            return
        held = [self.table(b).num_tokens for b in range(self.batch_size)]
        at = self.positions.tolist()
        if held == [p + input_ids.shape[1] for p in at]:
            return
        if held != at:
            raise ValueError(f"the block tables hold {held} tokens but the sequences are at {at}: a forward "
                             f"of this paged cache went around its tables")
        self.append_tokens(input_ids)

    def drop_tokens(self, index: int, n: int) -> None:
        """Sequence `index` gives back its last `n` tokens, which a `Rollback.apply` takes back on
        the device: the blocks past the kept tokens return to the pool, and the block they end in
        becomes the sequence's own (copied if it came to be shared since the forward), so the rows
        the apply clears there are no one else's. Right after the forward's own apply, or before
        a later one (a trim)."""
        if n:
            self._copy_blocks(self.table(index).drop(n))
            self._refresh([index])

    def name_tokens(self, index: int, ids) -> None:
        """Sequence `index`'s last len(ids) tokens, taken tentatively, are `ids` (so its blocks
        can be registered once final)."""
        self.table(index).name_tokens(list(ids))

    def commit_tokens(self, index: int) -> None:
        """Sequence `index`'s tokens are final: its full blocks are registered now (a tentative
        step's are otherwise at the next forward), so other sequences' prefixes find them."""
        self.table(index).commit()

    def check_room(self, new_tokens: int, n: int | None = None) -> None:
        super().check_room(new_tokens, n)
        end = self.batch_size if n is None else n
        held = [self.table(b).num_tokens for b in range(end)]
        before, after = self.positions[:end].tolist(), (self.positions[:end] + new_tokens).tolist()
        if held != after and held != before:  # (before: the tokens are taken by the forward itself)
            raise ValueError(f"the block tables hold {held} tokens but the sequences are at {before}: a "
                             f"forward of this paged cache went around its tables")

    # ------------------------------------------------------------------ sharing
    def _shares_pool(self, source) -> bool:
        return isinstance(source, PagedDS4Cache) and source.pool is self.pool

    def fork(self, dst_index: int, src_index: int, source: "PagedDS4Cache | None" = None) -> None:
        """Sequence `dst_index` continues from sequence `src_index` of `source` (this cache, or a
        view sharing its pool): its blocks shared (not copied), its ring, open windows, position
        and MTP state copied."""
        source = self if source is None else source
        if not self._shares_pool(source):
            raise ValueError("fork shares blocks of this pool (this cache or a view of it); copy_sequence copies "
                             "from other caches")
        self._check_index(dst_index)
        source._check_index(src_index)
        root, dst, src = self._root, self._offset + dst_index, source._offset + src_index
        root._branch(dst, src, root.take_checkpoint(src))
        if root.mtp is not None:  # the MTP layers' state (a static cache) comes along
            root.mtp.copy_sequence(dst, src)

    def copy_sequence(self, dst_index: int, src_index: int, source: "DS4Cache | None" = None) -> None:
        """As `DS4Cache.copy_sequence`: from this pool (this cache or a view of it) a `fork`, the
        blocks shared; from a static cache or another pool the rows copied into new blocks of
        this one, private (their tokens are unknown here)."""
        if source is None or self._shares_pool(source):
            self.fork(dst_index, src_index, source)
        else:
            super().copy_sequence(dst_index, src_index, source)

    def branch_from_checkpoint(self, dst_index: int, src_index: int, checkpoint, source=None) -> None:
        """As `DS4Cache.branch_from_checkpoint`; from this pool (this cache or a view of it) the
        rows shared instead of copied: `dst_index` takes `src_index`'s blocks up to the
        checkpoint's position (a partly used last block is copied on the first write) and the
        checkpoint. From a static cache or another pool the rows are copied in."""
        if source is not None and not self._shares_pool(source):
            super().branch_from_checkpoint(dst_index, src_index, checkpoint, source)  # (via import_sequence)
            return
        source = self if source is None else source
        self._check_index(dst_index)
        source._check_index(src_index)
        self._root._branch(self._offset + dst_index, source._offset + src_index, checkpoint)

    def _branch(self, dst: int, src: int, checkpoint) -> None:
        """`branch_from_checkpoint` within this cache (the root: indices global)."""
        self.check_usable_index(src)
        n = int(checkpoint["position"])
        if n > self.table(src).num_tokens:
            raise ValueError(f"cannot branch from sequence {src} at position {n}: it holds only "
                             f"{self.table(src).num_tokens} tokens")
        table = self.table(src).fork()
        table.truncate(n)
        self._take(dst, table, checkpoint)

    def start_from_cache(self, index: int, tokens, checkpoint, tenant: str | None = None) -> None:
        """Sequence `index` starts from the pool's cached blocks of `tokens` up to the checkpoint's
        position p (taken on any sequence with those first p tokens; p must be a whole number of
        cached blocks: `cached_tokens` says how many there are)."""
        n = int(checkpoint["position"])
        table = BlockTable.from_prefix(self.pool, list(tokens)[:n], tenant)
        if table.num_tokens != n:
            table.free()
            raise ValueError(f"the pool holds {table.num_tokens} tokens of this prefix in whole blocks, not the "
                             f"checkpoint's {n}")
        self._take(index, table, checkpoint)

    def cached_tokens(self, tokens, tenant: str | None = None) -> int:
        """How many first tokens of `tokens` the pool's cached blocks cover."""
        return len(self.pool.lookup(list(tokens), tenant)) * self.pool.block_tokens

    def _take(self, index: int, table: BlockTable, checkpoint) -> None:
        from .cache import check_checkpoint_layout

        try:
            n = check_checkpoint_layout(self.config, self.dtype, self.max_context, checkpoint)
        except ValueError:
            table.free()
            raise
        self._install(index, table)
        self._write_sequence(index, {k: v for k, v in checkpoint.items() if k not in ("row_counts", "logits")}, n)

    def _install(self, index: int, table: BlockTable) -> None:
        """Sequence `index` holds `table` (its old one released)."""
        self.table(index).free()
        self.all_tables[self._offset + index] = table
        self._refresh([index])

    # ------------------------------------------------------------------ whole sequences
    def _sequence_state(self, index: int, n: int) -> dict[str, torch.Tensor]:
        """As `DS4Cache._sequence_state`, the rows gathered through the table (copies)."""
        out = self._sequence_views(index, n)  # (everything but the rows)
        for i, layer in enumerate(self.layers):
            for part, state in (("compressor", layer.compressor), ("indexer", layer.indexer)):
                if state is not None:
                    for name, t in state.row_parts().items():
                        out[f"layers.{i}.{part}.{name}"] = t[state.slots[index, :n // layer.rate]]
        return {name: out[name] for name, _, _ in self.sequence_spec(n)}

    def import_sequence(self, index: int, state, tokens=None, tenant: str | None = None) -> None:
        """As `DS4Cache.import_sequence`, into a fresh table of blocks for the state's position
        (`tenant`'s). With its `tokens` (as many as the position) the full blocks are registered
        under their digests, so later prefixes share them; without, they stay private (a digest
        is never computed from unknown tokens). Checked before anything changes: a ValueError
        for the state or tokens, PoolExhausted when the pool cannot supply the blocks (counting
        those the sequence's old table gives back)."""
        self._check_index(index)
        n = self._check_state(state)
        if tokens is not None:
            tokens = [int(t) for t in tokens]
            if len(tokens) != n:
                raise ValueError(f"{len(tokens)} tokens for a state at position {n}")
        old = self.table(index)
        need = math.ceil(n / self.pool.block_tokens)
        released = sum(1 for b in set(old.blocks) if self.pool.refcount(b) == 1)
        if need > self.pool.num_available + released:
            raise PoolExhausted(f"a state of {n} tokens needs {need} KV blocks, {self.pool.num_available + released} "
                                f"of {self.pool.num_blocks} are available")
        old.free()  # (first: its blocks may be the ones the new table needs)
        table = BlockTable(self.pool, tenant)
        table.append([None] * n if tokens is None else tokens)
        self._install(index, table)
        self._write_sequence(index, state, n)
        for i, layer in enumerate(self.layers):
            for part, s in (("compressor", layer.compressor), ("indexer", layer.indexer)):
                if s is not None and n // layer.rate:
                    at = s.slots[index, :n // layer.rate]
                    for name, t in s.row_parts().items():
                        rows = state[f"layers.{i}.{part}.{name}"].to(t.device)
                        _flat_bytes(t).index_copy_(0, at, _flat_bytes(rows))

    def _restore_checkpoint(self, index: int, checkpoint) -> None:
        super()._restore_checkpoint(index, checkpoint)
        self.table(index).truncate(int(checkpoint["position"]))
        self._refresh([index])

    def new_sequence(self, index: int, tenant: str | None = None) -> None:
        """Empty slot `index` for a new sequence of `tenant` (whose full blocks only that
        tenant's sequences can find)."""
        self.reset(index)
        self.all_tables[self._offset + index] = BlockTable(self.pool, tenant)

    def reset(self, batch_index: int | None = None) -> None:
        super().reset(batch_index)
        for b in range(self.batch_size) if batch_index is None else [batch_index]:
            self.table(b).free()
        self._refresh(range(self.batch_size) if batch_index is None else [batch_index])

    def _view(self, start: int, n: int) -> "PagedDS4Cache":
        view = super()._view(start, n)  # the states' slots sliced, the pools shared
        view._slots = {rate: t[start:start + n] for rate, t in self._slots.items()}
        return view
