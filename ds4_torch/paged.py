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
  first copies it (copy on write).
- `BlockTable`: one sequence's blocks in order, its tokens, and the digests of its full blocks.
  `append` returns the block copies the caller must make before writing rows; `fork` shares
  every block; `truncate` rewinds; `free` releases.
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

import torch

from .cache import CompressorState, DS4Cache, _compressor_state
from .config import DS4Config

__all__ = ["PoolExhausted", "chain_digest", "block_nbytes", "pool_blocks", "BlockPool", "BlockTable", "PagedDS4Cache"]

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
            del self._block_of[self._digest_of.pop(block)]
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

    def register(self, block: int, digest: bytes) -> bool:
        """Cache held, full `block` under `digest`. False (and nothing changes) when another
        block already holds that digest: `block` stays a private copy."""
        if self._refcounts[block] <= 0:
            raise ValueError(f"block {block} is not held")
        if digest in self._block_of or block in self._digest_of:
            return False
        self._block_of[digest] = block
        self._digest_of[block] = digest
        return True

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
    [k*bt/m, (k+1)*bt/m)); `tokens` the token ids so far; `digests[k]` the chain digest of full
    block k."""

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
        if new_tokens <= 0:
            return 0
        bt, n = self.pool.block_tokens, len(self.tokens)
        grow = math.ceil((n + new_tokens) / bt) - len(self.blocks)
        writes_held = n < len(self.blocks) * bt  # the new rows start inside the last held block
        return grow + (1 if writes_held and not self.pool.writable(self.blocks[n // bt]) else 0)

    def append(self, tokens: Sequence[int]) -> list[tuple[int, int]]:
        """Extend by `tokens`: allocate the blocks they reach, copy a shared or registered block
        they write into, register every block they fill. Returns the (source, destination)
        copies to make, in order, before writing the new rows. PoolExhausted (nothing changed)
        when the pool cannot supply the blocks."""
        pool, bt = self.pool, self.pool.block_tokens
        need = self.blocks_needed(len(tokens))
        if need > pool.num_available:
            raise PoolExhausted(f"{len(tokens)} more tokens need {need} KV blocks, {pool.num_available} "
                                f"of {pool.num_blocks} are available")
        copies = []
        n = len(self.tokens)
        if tokens and n < len(self.blocks) * bt:  # writes into the last held block
            k = n // bt
            if not pool.writable(self.blocks[k]):
                new = pool.allocate()
                copies.append((self.blocks[k], new))
                pool.decref(self.blocks[k])
                self.blocks[k] = new
        self.tokens.extend(int(t) for t in tokens)
        while len(self.blocks) * bt < len(self.tokens):
            self.blocks.append(pool.allocate())
        for k in range(len(self.digests), len(self.tokens) // bt):
            parent = self.digests[-1] if self.digests else None
            self.digests.append(chain_digest(parent, self.tenant, self.tokens[k * bt:(k + 1) * bt]))
            pool.register(self.blocks[k], self.digests[k])
        return copies

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
    [B, C+1] int64 the pool row of each sequence's row w, rebuilt from the tables; the model
    writes through it (`CompressorState.write_rows`) and hands the attention and top-k ops the
    pool and slots (`CompressorState.kernel_rows`: the Triton kernels read the rows in place, the
    reference gathers them; fp8 rows are gathered, dequantized, by `visible`), so its logits are
    the static cache's, bit for bit. The window ring, open windows and positions stay per
    sequence, as in `DS4Cache` (checkpoints take them as usual).

    Before each forward, `append_tokens(ids)` gives every sequence the blocks its new tokens
    reach (a forward without it is refused). Sharing: `fork` (continue another sequence's state,
    no copy), `branch_from_checkpoint` (another sequence's blocks up to a checkpoint's position),
    `start_from_cache` (the pool's cached blocks of a prefix, plus a checkpoint at their end).
    `num_blocks` defaults to a pool for `batch_size` sequences of `max_context` tokens.

    Not yet: export/import/copy of a sequence's rows, forwards with undo (speculation), compile
    and CUDA graphs (the slots are plain tensors, but untested there). The MTP layers' state
    stays a static `DS4Cache` (`mtp`)."""

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
        super().__init__(config, batch_size, max_context, dtype, device, kv_rows)

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

    @property
    def nbytes(self) -> int:
        """Every tensor's bytes: the pool's, every sequence's own state and its slot map."""
        return super().nbytes + sum(t.numel() * t.element_size() for t in self._slots.values())

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
        """Rebuild the slots of sequences `indices` from their tables."""
        for rate, slots in self._slots.items():
            per_block = self.pool.block_tokens // rate
            scratch, C = self.pool.num_blocks * per_block, slots.shape[1] - 1
            w = torch.arange(C, dtype=torch.long)
            for b in indices:
                blocks = torch.tensor(self.table(b).blocks + [0], dtype=torch.long)  # (+1: never empty)
                k = w // per_block
                held = k < len(self.table(b).blocks)
                row = torch.where(held, blocks[k.clamp(max=len(blocks) - 1)] * per_block + w % per_block, scratch)
                slots[b, :C] = row.to(slots.device)

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

    def append_tokens(self, input_ids: torch.Tensor) -> None:
        """Before a forward of `input_ids` [B, T]: every sequence's table takes its T tokens
        (blocks allocated, shared blocks it writes copied). PoolExhausted when the pool cannot
        supply them: sequences before the failing one keep their new blocks, so free or preempt
        and retry, or reset them."""
        if input_ids.dim() != 2 or input_ids.shape[0] != self.batch_size:
            raise ValueError(f"input_ids must be [{self.batch_size}, tokens], got {tuple(input_ids.shape)}")
        changed = []
        for b, row in enumerate(input_ids.tolist()):
            before = list(self.table(b).blocks[-1:]), len(self.table(b).blocks)
            self._copy_blocks(self.table(b).append(row))
            if (self.table(b).blocks[before[1] - 1:before[1]], len(self.table(b).blocks)) != before:
                changed.append(b)  # a new block or a copy: its slots change (most decode steps: none)
        self._refresh(changed)

    def take_tokens(self, input_ids: torch.Tensor) -> None:
        """Before a forward of `input_ids` [B, T] (the model's forward, the decoders and `prefill`
        call it): `append_tokens` unless the caller already did."""
        held = [self.table(b).num_tokens for b in range(self.batch_size)]
        at = self.positions.tolist()
        if held == [p + input_ids.shape[1] for p in at]:
            return
        if held != at:
            raise ValueError(f"the block tables hold {held} tokens but the sequences are at {at}: a forward "
                             f"of this paged cache went around its tables")
        self.append_tokens(input_ids)

    def check_room(self, new_tokens: int, n: int | None = None) -> None:
        super().check_room(new_tokens, n)
        end = self.batch_size if n is None else n
        held = [self.table(b).num_tokens for b in range(end)]
        before, after = self.positions[:end].tolist(), (self.positions[:end] + new_tokens).tolist()
        if held != after and held != before:  # (before: the tokens are taken by the forward itself)
            raise ValueError(f"the block tables hold {held} tokens but the sequences are at {before}: a "
                             f"forward of this paged cache went around its tables")

    # ------------------------------------------------------------------ sharing
    def fork(self, dst_index: int, src_index: int) -> None:
        """Sequence `dst_index` continues from sequence `src_index`'s state: its blocks shared
        (not copied), its ring, open windows and position copied."""
        self.branch_from_checkpoint(dst_index, src_index, self.take_checkpoint(src_index))
        if self.mtp is not None:  # the MTP layers' state (a static cache) comes along
            self.mtp.copy_sequence(dst_index, src_index)

    def branch_from_checkpoint(self, dst_index: int, src_index: int, checkpoint, source=None) -> None:
        """As `DS4Cache.branch_from_checkpoint`, the rows shared instead of copied: `dst_index`
        takes `src_index`'s blocks up to the checkpoint's position (a partly used last block is
        copied on the first write) and the checkpoint."""
        if source is not None and source is not self:
            raise ValueError("a paged cache branches from its own sequences (they share its pool)")
        self._check_index(dst_index)
        self._check_index(src_index)
        self.check_usable_index(src_index)
        n = int(checkpoint["position"])
        if n > self.table(src_index).num_tokens:
            raise ValueError(f"cannot branch from sequence {src_index} at position {n}: it holds only "
                             f"{self.table(src_index).num_tokens} tokens")
        table = self.table(src_index).fork()
        table.truncate(n)
        self._take(dst_index, table, checkpoint)

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
        self.table(index).free()
        self.all_tables[self._offset + index] = table
        self._write_sequence(index, {k: v for k, v in checkpoint.items() if k not in ("row_counts", "logits")}, n)
        self._refresh([index])

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

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("exporting, importing or copying a paged sequence's rows is not supported yet: "
                                  "use fork / branch_from_checkpoint / start_from_cache")

    export_sequence = import_sequence = copy_sequence = _unsupported

    def _view(self, start: int, n: int) -> "PagedDS4Cache":
        view = super()._view(start, n)  # the states' slots sliced, the pools shared
        view._slots = {rate: t[start:start + n] for rate, t in self._slots.items()}
        return view
