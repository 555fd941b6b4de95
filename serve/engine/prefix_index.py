"""Which registered token sequence a prompt can reuse, and from where.

The engine registers every sequence whose cache state it can bring back (a resident session, a
disk snapshot) under an opaque key and a tenant (the API key: reuse never crosses tenants), with
the positions where a state of it is available: its checkpoints (`DS4Cache.take_checkpoint`)
and its end (a session's live state, a snapshot's saved one). `match(tenant, prompt)` answers,
exactly:

- `common`: the longest common prefix of the prompt with any of the tenant's sequences;
- `reuse`: the furthest available state at or below the divergence, that is the largest
  checkpoint or end position c of any sequence e with prompt[:c] == e[:c], and every
  (key, kind) holding a state there (equivalent: same tokens before c), so the caller can
  prefer an idle session over a busy one, or a resident one over a snapshot.

Structure: chained block hashes (as vLLM and SGLang key their prefix caches). Tokens are cut into
blocks of `block_size`; block k of a sequence is named by h_k = hash((h_{k-1}, block k)), and
nodes are keyed by (tenant, h_k), so one dict lookup tells whether any sequence of the tenant
shares the prompt's first k+1 blocks (the tenant is compared, not hashed into h: no collision can
cross tenants). Each block node keeps the sequences through it, the marks (checkpoint or end) that lie
within the next block (by their tail: the tokens between the block end and the mark) and the
distinct next-block continuations. A node also stores its block and its parent's hash, checked
on lookup: a hash collision is a miss, never a wrong answer.

Cost of `match`: hashing the prompt once (O(prompt)), one lookup per block, and at the blocks
walked, a comparison of at most `block_size` tokens per distinct mark tail or continuation
there (a handful: sequences sharing a prefix mostly share their marks). Pure Python; not
thread-safe (the engine's worker thread owns it).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

CHECKPOINT, END = "checkpoint", "end"
ROOT = None  # h_{-1}: no block hash (an int) equals it


@dataclass(frozen=True)
class PrefixMatch:
    common: int                                   # longest common prefix with any sequence
    common_key: Hashable | None                   # one sequence sharing it (None when common == 0)
    reuse: int                                    # furthest available state at or below the divergence
    sources: tuple[tuple[Hashable, str], ...]     # (key, CHECKPOINT or END) holding a state at `reuse`


@dataclass
class _Node:
    block: tuple | None            # None for a tenant's root (position 0)
    parent: int | None
    keys: set = field(default_factory=set)
    marks: dict = field(default_factory=dict)          # tail tuple -> {(key, kind)}
    continuations: dict = field(default_factory=dict)  # next block's tokens (<= block_size) -> {key}


@dataclass
class _Entry:
    tenant: Hashable
    tokens: list[int]
    hashes: list[int]              # [h_{-1}, h_0, h_1, ...]: the root, then one per full block
    checkpoints: set[int]


def _common(a: Sequence, b: Sequence) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixIndex:
    def __init__(self, block_size: int = 16):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self._nodes: dict[tuple, _Node] = {}  # (tenant, h_k), or (tenant, None) for a tenant's root
        self._entries: dict[Hashable, _Entry] = {}

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def tokens(self, key, start: int = 0, end: int | None = None) -> list[int]:
        return self._entry(key).tokens[start:end]

    def checkpoints(self, key) -> list[int]:
        return sorted(self._entry(key).checkpoints)

    def tenants(self) -> set:
        """The tenants with a sequence here."""
        return {e.tenant for e in self._entries.values()}

    def chain(self, prompt: Sequence[int]) -> list[int]:
        """The hashes of `prompt`'s full blocks, [h_{-1}, h_0, ...]: the same for every tenant and
        every index of this block size, so one prompt is hashed once (`match`, `shares`)."""
        return self._chain(None, prompt, len(prompt) // self.block_size)

    def match(self, tenant: Hashable, prompt: Sequence[int], max_reuse: int | None = None,
              chain: list[int] | None = None) -> PrefixMatch:
        """The longest common prefix and the best reusable state for `prompt` among `tenant`'s
        sequences (see the module's doc), that state at most at `max_reuse` when given (e.g.
        len(prompt) - 1, to leave a token to prefill where no logits were kept). `chain`:
        `chain(prompt)`, when the caller has it."""
        B = self.block_size
        chain = self._chain(tenant, prompt, len(prompt) // B) if chain is None else chain
        walked = [self._nodes.get((tenant, chain[0]))]
        if walked[0] is None:
            return PrefixMatch(0, None, 0, ())
        for k in range(1, len(chain)):
            node = self._nodes.get((tenant, chain[k]))
            if node is None or node.parent != chain[k - 1] or node.block != tuple(prompt[(k - 1) * B:k * B]):
                break
            walked.append(node)
        depth = len(walked) - 1  # full blocks shared with some sequence
        rest = prompt[depth * B:(depth + 1) * B]
        best_len, best_key = -1, None
        for block, keys in walked[-1].continuations.items():
            n = _common(block, rest)
            if n > best_len:
                best_len, best_key = n, next(iter(keys))
        common = depth * B + max(best_len, 0)
        if best_key is None:
            best_key = next(iter(walked[-1].keys))
        for k in range(depth, -1, -1):  # deepest first: the first node with a matching mark wins
            start = k * B
            found = [(start + len(tail), holders) for tail, holders in walked[k].marks.items()
                     if len(tail) <= len(prompt) - start and (max_reuse is None or start + len(tail) <= max_reuse)
                     and tuple(prompt[start:start + len(tail)]) == tail]
            if found:
                reuse = max(p for p, _ in found)
                sources = sorted({h for p, holders in found if p == reuse for h in holders}, key=repr)
                return PrefixMatch(common, best_key if common else None, reuse, tuple(sources))
        return PrefixMatch(common, best_key if common else None, 0, ())

    def shares(self, tenant: Hashable, prompt: Sequence[int], n: int, chain: list[int]) -> bool:
        """Whether a sequence of `tenant` shares at least the first `n` tokens of `prompt`
        (`chain`: `chain(prompt)`): one lookup and the next blocks' first tokens, not a walk. A
        hash collision can make it say True wrongly; `match` is exact."""
        B = self.block_size
        if n > len(prompt):
            return False
        k = max(n, 0) // B
        node = self._nodes.get((tenant, chain[k]))
        if node is None:
            return False
        rest = tuple(prompt[k * B:n])
        return not rest or any(block[:len(rest)] == rest for block in node.continuations)

    # ------------------------------------------------------------------ writing
    def add(self, key: Hashable, tenant: Hashable, tokens: Sequence[int], checkpoints: Sequence[int] = ()) -> None:
        """Register sequence `key` of `tenant` holding `tokens`, with checkpoints at the given
        positions (its end is always available)."""
        if key in self._entries:
            raise ValueError(f"prefix index: key {key!r} is already registered")
        entry = self._entries[key] = _Entry(tenant, [], [ROOT], set())
        node = self._nodes.setdefault((tenant, ROOT), _Node(None, None))
        node.keys.add(key)
        self._set_mark(key, entry, 0, END, True)
        self.extend(key, tokens)
        for p in checkpoints:
            self.add_checkpoint(key, p)

    def extend(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Sequence `key` grew by `tokens` (a prefill, decoded tokens)."""
        entry = self._entry(key)
        B = self.block_size
        last = len(entry.hashes) - 1
        self._set_mark(key, entry, len(entry.tokens), END, False)
        self._set_continuations(key, entry, last, False)
        entry.tokens.extend(int(t) for t in tokens)
        while len(entry.hashes) - 1 < len(entry.tokens) // B:
            k = len(entry.hashes) - 1
            block = tuple(entry.tokens[k * B:(k + 1) * B])
            h = hash((entry.hashes[-1], block))
            node = self._nodes.get((entry.tenant, h))
            if node is None:
                node = self._nodes[entry.tenant, h] = _Node(block, entry.hashes[-1])
            elif node.block != block or node.parent != entry.hashes[-1]:
                break  # a hash collision: index no deeper (the tail stays matchable by continuation)
            node.keys.add(key)
            entry.hashes.append(h)
        self._set_continuations(key, entry, last, True)
        self._set_mark(key, entry, len(entry.tokens), END, True)

    def truncate(self, key: Hashable, n: int) -> None:
        """Sequence `key` was rewound to its first `n` tokens: later tokens and checkpoints go."""
        entry = self._entry(key)
        if not 0 <= n <= len(entry.tokens):
            raise ValueError(f"prefix index: cannot truncate {key!r} to {n} of {len(entry.tokens)} tokens")
        for p in [p for p in entry.checkpoints if p > n]:
            self.remove_checkpoint(key, p)
        keep = min(n // self.block_size + 1, len(entry.hashes))
        self._set_mark(key, entry, len(entry.tokens), END, False)
        self._set_continuations(key, entry, keep - 1, False)
        for h in entry.hashes[keep:]:
            self._drop_key(entry.tenant, h, key)
        del entry.hashes[keep:], entry.tokens[n:]
        self._set_continuations(key, entry, keep - 1, True)
        self._set_mark(key, entry, n, END, True)

    def add_checkpoint(self, key: Hashable, position: int) -> None:
        entry = self._entry(key)
        if not isinstance(position, int) or not 0 <= position <= len(entry.tokens):
            raise ValueError(f"prefix index: checkpoint position {position!r} outside [0, {len(entry.tokens)}] "
                             f"for {key!r}")
        if position not in entry.checkpoints:
            entry.checkpoints.add(position)
            self._set_mark(key, entry, position, CHECKPOINT, True)

    def remove_checkpoint(self, key: Hashable, position: int) -> None:
        entry = self._entry(key)
        if position in entry.checkpoints:
            entry.checkpoints.discard(position)
            self._set_mark(key, entry, position, CHECKPOINT, False)

    def remove(self, key: Hashable) -> None:
        """Forget sequence `key` (evicted, deleted); unknown keys are ignored."""
        entry = self._entries.get(key)
        if entry is None:
            return
        for p in list(entry.checkpoints):
            self.remove_checkpoint(key, p)
        self._set_mark(key, entry, len(entry.tokens), END, False)
        self._set_continuations(key, entry, 0, False)
        for h in entry.hashes:
            self._drop_key(entry.tenant, h, key)
        del self._entries[key]

    # ------------------------------------------------------------------ internals
    def _entry(self, key) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"prefix index: unknown key {key!r}")
        return entry

    def _chain(self, tenant: Hashable, tokens: Sequence[int], blocks: int) -> list[int]:
        """[h_{-1}, h_0, ..., h_{blocks-1}] of `tokens`."""
        B, out = self.block_size, [ROOT]
        for k in range(blocks):
            out.append(hash((out[-1], tuple(tokens[k * B:(k + 1) * B]))))
        return out

    def _node_for(self, entry: _Entry, position: int) -> tuple[_Node, tuple]:
        """The node a mark at `position` hangs on (its last full block before it, as far as the
        entry is indexed) and the mark's tail."""
        B = self.block_size
        k = min(position // B, len(entry.hashes) - 1)
        return self._nodes[entry.tenant, entry.hashes[k]], tuple(entry.tokens[k * B:position])

    def _set_mark(self, key, entry: _Entry, position: int, kind: str, present: bool) -> None:
        node, tail = self._node_for(entry, position)
        if len(tail) >= self.block_size:
            return  # past a hash collision: not reachable by a match (rare, and only costs reuse)
        holders = node.marks.setdefault(tail, set())
        (holders.add if present else holders.discard)((key, kind))
        if not holders:
            del node.marks[tail]

    def _set_continuations(self, key, entry: _Entry, first: int, present: bool) -> None:
        """Add or remove `key`'s continuation (the next block's tokens, full or not) at its nodes
        hashes[first:]."""
        B = self.block_size
        for j in range(first, len(entry.hashes)):
            node = self._nodes[entry.tenant, entry.hashes[j]]
            block = tuple(entry.tokens[j * B:(j + 1) * B])
            holders = node.continuations.setdefault(block, set())
            (holders.add if present else holders.discard)(key)
            if not holders:
                del node.continuations[block]

    def _drop_key(self, tenant: Hashable, h: int | None, key) -> None:
        node = self._nodes.get((tenant, h))
        if node is None:
            return
        node.keys.discard(key)
        if not node.keys:
            del self._nodes[tenant, h]
