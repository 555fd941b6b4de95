"""A speculative step's rollback record belongs to the rows as they were in that step. Between the
step and a trim (a stop string the output part found among its tokens, one iteration later), a
server changes the batch: a request that ended is released and the last row moves into its hole,
a new request joins a row that idled in the step (a padding row of a captured step's power-of-two
width). The trim must give back only the stopping request's tokens, from the row it stands in
now, and leave every other row exactly as it is.

The independent expectation is plain greedy decoding of each prompt alone: every request's
tokens and verified logits (<= 1e-5), and, for the one that stopped, a continuation from what its
row kept (the session's next turn) that is still plain greedy decoding. Over a paged cache (blocks
of 6 tokens: verify steps cross block boundaries, and rejected drafts close rows of both rates)
every step is also the static cache's, driven alike, bit for bit: tokens, logits and states."""

from __future__ import annotations

import pytest
import torch

from ds4_torch.paged import PagedDS4Cache
from ds4_torch.sampling import BatchSampler, SamplingParams
from ds4_torch.speculative import Speculator
from test_paged import assert_slots_follow_tables
from test_speculative import model, plain_decode  # noqa: F401 - `model`: the small random MTP model fixture

torch.set_num_threads(1)

NEW = 30
BLOCK = 6  # a paged cache's block: a multiple of the rates (2 and 3), crossed by many verify steps
PROMPTS = [[3, 14, 15], list(range(1, 8)), [5, 9, 11, 2, 40, 33, 7, 7, 1, 60, 22, 13], [8, 6, 4, 2, 1],
           [31, 41, 59, 26, 53, 58, 9]]


@pytest.fixture(scope="module")
def truth(model):
    return [plain_decode(model, p, NEW) for p in PROMPTS]


class Batch:
    """A speculator over a 4-row cache driven as the server drives its batch: rows join, leave
    (the last row filling the hole) and are trimmed by the request they hold."""

    def __init__(self, model, n, mode, paged=False):
        self.model, self.n = model, n
        ctx = max(map(len, PROMPTS)) + NEW + 2 * n + 4
        # (rows run on until every row has NEW tokens, past ctx: a pool twice the size holds them)
        self.cache = (PagedDS4Cache(model.config, 4, ctx, block_tokens=BLOCK, num_blocks=8 * -(-ctx // BLOCK))
                      if paged else model.new_cache(4, ctx))
        # A paged batch drives a static twin alike and checks every output against it, bit for bit.
        self.twin = Batch(model, n, mode) if paged else None
        self.crossed = 0  # verify steps that crossed a block boundary and rejected a draft
        self.sampler = BatchSampler(4, model.config.vocab_size, model.device)
        self.spec = Speculator(model, self.cache, self.sampler, n, batch=4, mode=mode)
        self.rows: list[int] = []                  # rows[b]: the prompt whose request row b holds
        self.tokens: dict[int, list[int]] = {}     # per prompt: the tokens it took
        self.logits: dict[int, list[torch.Tensor]] = {}

    def join(self, p):
        b = len(self.rows)
        self.sampler.admit(b, SamplingParams())
        first, logits = self.spec.start_row(b, PROMPTS[p], 4)
        self.rows.append(p)
        self.tokens[p], self.logits[p] = [first], [logits.float()[None]]
        self._same_as_twin(lambda twin: twin.join(p))

    def step(self):
        starts = self.cache.positions.tolist()
        got, rows = self.spec.step_batch([self.n + 1] * len(self.rows))
        for b, p in enumerate(self.rows):
            self.tokens[p] += got[b]
            self.logits[p].append(rows[b])
            self.crossed += len(got[b]) < self.n + 1 and starts[b] // BLOCK != (starts[b] + self.n) // BLOCK
        counts = [len(g) for g in got]
        assert self._same_as_twin(lambda twin: twin.step()) in (None, counts)
        return counts

    def trim(self, used):
        self.spec.trim(used)
        self._same_as_twin(lambda twin: twin.trim(used))

    def rejoin(self, b, first):
        """Row b's session goes on from its last token (its next turn)."""
        self.spec.join_row(b, first, None)
        self._same_as_twin(lambda twin: twin.rejoin(b, first))

    def _same_as_twin(self, op):
        if self.twin is None:
            return None
        out = op(self.twin)
        assert self.cache.positions.tolist() == self.twin.cache.positions.tolist()
        assert [t.num_tokens for t in self.cache.tables] == self.cache.positions.tolist()
        assert_slots_follow_tables(self.cache)
        for b, p in enumerate(self.rows):
            assert self.tokens[p] == self.twin.tokens[p]
            assert torch.equal(torch.cat(self.logits[p]), torch.cat(self.twin.logits[p])), f"prompt {p}"
            got, want = self.cache.export_sequence(b), self.twin.cache.export_sequence(b)
            assert all(torch.equal(got[k], want[k]) for k in want), f"row {b}"
        return out

    def leave(self, b):
        """Row b's request ended: its row is taken by the last one (its cache slot copied first)."""
        if self.twin is not None:
            self.twin.leave(b)
        last = len(self.rows) - 1
        if b != last:
            self.cache.copy_sequence(b, last)
            self.spec.move_row(b, last)
            self.sampler.move(b, last)
            self.rows[b] = self.rows[last]
        self.sampler.release(last)
        self.cache.reset(last)
        self.rows.pop()

    def run_to_end(self):
        while min(len(self.tokens[p]) for p in self.rows) < NEW:
            self.step()


def check_plain(batch, truth, prompts):
    for p in prompts:
        want_tokens, want_rows = truth[p]
        assert batch.tokens[p][:NEW] == want_tokens, f"prompt {p}"
        got_rows = torch.cat(batch.logits[p])[:NEW]
        torch.testing.assert_close(got_rows, want_rows, atol=1e-5, rtol=0, msg=f"prompt {p}")


@torch.no_grad()
# The graph path over the paged pool only: the server's caches are paged, and the static cache's
# rows are the eager cases'.
@pytest.mark.parametrize("n,mode,paged", [(2, "eager", False), (3, "eager", False), (3, "eager", True),
                                          (2, "graph", True)])
def test_trim_after_release_move_and_join_touches_only_the_stopped_row(model, truth, n, mode, paged):
    batch = Batch(model, n, mode, paged)
    for p in (0, 1, 2):  # three rows: graph mode runs four, the fourth a padding row
        batch.join(p)
    # a first step whose tokens all stand, so the next one's drafts are the MTP layer's own
    batch.step()
    counts = []
    while not counts or counts[2] < 2:  # a step in which prompt 2 (row 2) takes at least 2 tokens
        counts = batch.step()
    taken_in_step = counts[2]
    # 1. prompt 0's request ends (by length, say): the last row (prompt 2) moves into row 0
    batch.leave(0)
    assert batch.rows == [2, 1]
    # 2. two requests join: row 2 (the moved row's old place) and row 3 (a padding row in graph mode)
    batch.join(3)
    batch.join(4)
    positions = [int(p) for p in batch.cache.positions]
    # 3. the output part found a stop string after prompt 2's first token of that step: it keeps
    # that token (the reply's last: not fed) and gives the rest back, from row 0 where it stands
    batch.trim([1, None, None, None])
    kept = len(batch.tokens[2]) - taken_in_step + 1   # the tokens prompt 2 took, the stop's last included
    assert int(batch.cache.positions[0]) == len(PROMPTS[2]) + kept - 1
    assert [int(p) for p in batch.cache.positions[1:]] == positions[1:]
    assert batch.spec.positions[1:] == positions[1:]
    # its session's next turn: the same row goes on from the stop's last token
    for b in (batch, batch.twin) if paged else (batch,):
        del b.tokens[2][kept:]
        b.logits[2] = [torch.cat(b.logits[2])[:kept]]
    batch.rejoin(0, batch.tokens[2][-1])
    batch.run_to_end()
    check_plain(batch, truth, [2, 1, 3, 4])
    assert not paged or batch.crossed


@torch.no_grad()
@pytest.mark.parametrize("mode,paged", [("eager", False), ("graph", False), ("eager", True)])
def test_trim_of_a_row_that_ended_in_place_leaves_the_others(model, truth, mode, paged):
    """The last row's request ends and leaves (no move); a request joins in its place, another
    row is trimmed: neither the joined row nor the untrimmed ones move."""
    batch = Batch(model, 2, mode, paged)
    for p in (0, 1, 2):
        batch.join(p)
    counts = []
    while not counts or counts[0] < 2:
        counts = batch.step()
    batch.leave(2)
    batch.join(3)
    before = [int(p) for p in batch.cache.positions]
    batch.trim([1])
    kept = len(batch.tokens[0]) - counts[0] + 1
    assert [int(p) for p in batch.cache.positions] == [len(PROMPTS[0]) + kept - 1, *before[1:]]
    for b in (batch, batch.twin) if paged else (batch,):
        del b.tokens[0][kept:]
        b.logits[0] = [torch.cat(b.logits[0])[:kept]]
    batch.rejoin(0, batch.tokens[0][-1])
    batch.run_to_end()
    check_plain(batch, truth, [0, 1, 3])


@torch.no_grad()
def test_a_step_the_pool_cannot_supply_changes_nothing(model, truth):
    """A speculative step over a paged cache whose pool is full is refused before it runs
    (PoolExhausted): no row moves or is invalidated; once blocks are freed the same row goes on
    as plain greedy decoding."""
    from ds4_torch.decode import prefill
    from ds4_torch.paged import PoolExhausted

    cache = PagedDS4Cache(model.config, 2, 64, block_tokens=BLOCK, num_blocks=8)
    sampler = BatchSampler(1, model.config.vocab_size, model.device)
    sampler.admit(0, SamplingParams())
    spec = Speculator(model, cache, sampler, 2, batch=1)
    first, _ = spec.start_row(0, PROMPTS[2], 4)                        # 12 tokens: 2 blocks
    prefill(model, cache.slot(1), torch.arange(1, 37).view(1, -1), 8)  # 36 tokens: the other 6
    before = (cache.positions.tolist(), [list(t.blocks) for t in cache.tables], list(spec.positions))
    assert spec.blocks_needed(1) == 1 > cache.pool.num_available == 0
    with pytest.raises(PoolExhausted):
        spec.step_batch([3])
    assert (cache.positions.tolist(), [list(t.blocks) for t in cache.tables], list(spec.positions)) == before
    assert not cache.is_invalid(0)
    cache.reset(1)
    tokens = [first]
    while len(tokens) < NEW:
        tokens += spec.step_batch([3])[0][0]
    assert tokens[:NEW] == truth[2][0]


@torch.no_grad()
def test_an_idle_row_leaves_the_blocks_it_shares_as_they_are(model):
    """A row idle in a speculative step (limit 0) over a paged cache runs the step as every row
    does (its tokens taken tentatively, then all given back), so the partial block it shares with
    a sequence outside the step is copied before it writes, and that sequence is left as it was;
    the stepping row is the static cache's, bit for bit."""
    from ds4_torch.paged import PagedDS4Cache

    caches = [model.new_cache(3, 64), PagedDS4Cache(model.config, 3, 64, block_tokens=BLOCK)]
    specs = []
    for cache in caches:
        sampler = BatchSampler(2, model.config.vocab_size, model.device)
        spec = Speculator(model, cache, sampler, 2, batch=2)
        for b, p in enumerate((3, 4)):
            sampler.admit(b, SamplingParams())
            spec.start_row(b, PROMPTS[p], 4)
        cache.copy_sequence(2, 0)  # sequence 2 (outside the speculator's rows) shares row 0's blocks
        specs.append(spec)
    paged = caches[1]
    held, states = list(paged.table(2).blocks), [paged.export_sequence(b) for b in (0, 2)]
    assert held == paged.table(0).blocks and len(PROMPTS[3]) % BLOCK  # a shared partial block
    for _ in range(3):
        (got, got_rows), (want, want_rows) = (spec.step_batch([0, 3]) for spec in reversed(specs))
        assert got == want and all(torch.equal(a, b) for a, b in zip(got_rows, want_rows))
    assert paged.table(2).blocks == held and paged.table(0).num_tokens == len(PROMPTS[3])
    assert paged.table(0).blocks[-1] != held[-1]  # (the idle row's copy)
    for b, state in zip((0, 2), states):
        after = paged.export_sequence(b)
        assert all(torch.equal(after[k], state[k]) for k in state)
    after, want = paged.export_sequence(1), caches[0].export_sequence(1)
    assert all(torch.equal(after[k], want[k]) for k in want)
