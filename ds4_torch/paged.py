"""Paged compressed KV: the bookkeeping of a block pool and of one block table per sequence.

Compressed rows (CSA, indexer, HCA) are append-only and causal: the rows of tokens
[k*bt, (k+1)*bt) are fully determined by the tokens up to (k+1)*bt. So the cache can be cut
into blocks of `block_tokens` (bt) tokens of context, and a block that is full can be shared by
every sequence with the same first (k+1)*bt tokens. A block of bt tokens holds bt / m rows of
each layer of rate m (V4-Flash, bt = 256: 64 CSA rows and 64 indexer rows, 2 HCA rows), so bt
must be a multiple of every rate. The window ring and the open windows are not paged: they stay
per running sequence and in checkpoints (`DS4Cache.take_checkpoint`), which is what keeps reuse
exact at any divergence point.

This module holds no tensors; it says which physical block holds which rows and when a block's
rows must be copied. The tensor side (one storage of `num_blocks` blocks per layer) does what
it says.

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

__all__ = ["PoolExhausted", "chain_digest", "BlockPool", "BlockTable"]

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
        return block

    def incref(self, block: int) -> None:
        if self._refcounts[block] == 0:
            if block not in self._cached:
                raise ValueError(f"block {block} is free: allocate it instead")
            del self._cached[block]  # reused: no longer a reclaim candidate
        self._refcounts[block] += 1

    def decref(self, block: int) -> None:
        count = self._refcounts[block]
        if count <= 0:
            raise ValueError(f"block {block} is not held")
        self._refcounts[block] = count - 1
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
