"""Stop strings in a stream of text pieces, at a cost per character bounded by the longest stop.

`StopMatcher.push(piece)` releases the text that can no longer be part of a stop string and holds
back the rest: exactly the longest suffix of the text so far that is a proper prefix of some stop.
When a piece completes a stop, the text ends where the earliest-starting stop in the text not yet
released begins (every stop found then ends in that piece), and the matcher has stopped.

The stops are an Aho-Corasick automaton over characters (`StopAutomaton`): its state after each
character is the longest suffix of the text that is a prefix of a stop (its depth is what is held
back), and `longest[state]` the longest stop ending there. A character costs one transition plus
the failure links it follows: at most the longest stop's length, two steps per character
amortized, whatever the number and length of the stops (the scan it replaces cost
stops x length^2 per piece with adversarial stops). The automaton is built lazily: a node's
children (and their failure links) are made when the text first reaches it, so a request pays
for the part of its stops its text matches, not for all of them up front (64 stops of 1,000
characters are 64,000 nodes; building them all costs ~150 ms of the output thread).
"""
from __future__ import annotations

ROOT = 0


class StopAutomaton:
    """Aho-Corasick over the characters of `stops` (non-empty strings), built on demand. Node 0
    is the root. Per node: `children` ({character: node}, None until made by `expand`), `fail`
    (the node of the longest proper suffix of its string that is a prefix of a stop), `depth`
    (its string's length), `longest` (the longest stop that is a suffix of its string; 0: none)
    and `through` (the stops it is a prefix of, until its children are made). `built` counts
    the work done making nodes (one per stop examined)."""

    def __init__(self, stops):
        stops = tuple(stops)
        if not stops or any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stops = stops
        self.children: list[dict[str, int] | None] = [None]
        self.fail, self.depth, self.longest = [ROOT], [0], [0]
        self.through: list[list[int] | None] = [list(range(len(stops)))]
        self.built = 0
        self.expand(ROOT)

    def expand(self, u: int) -> dict[str, int]:
        """The children of `u`, made first if need be, with those of the nodes on its failure
        chain (their failure links walk that chain): shallowest first."""
        kids = self.children[u]
        if kids is not None:
            return kids
        chain, f = [], u
        while self.children[f] is None:  # ends at the root, made first of all
            chain.append(f)
            if f == ROOT:
                break
            f = self.fail[f]
        for x in reversed(chain):
            self._make_children(x)
        return self.children[u]

    def _make_children(self, x: int) -> None:
        d, stops, through = self.depth[x], self.stops, self.through[x]
        self.built += len(through)
        if len(through) == 1:  # one stop: a chain (most nodes of long stops)
            s = stops[through[0]]
            groups = {s[d]: through} if len(s) > d else {}
            ends = {s[d]} if len(s) == d + 1 else ()
        else:
            groups, ends = {}, set()  # ends: characters with which a stop ends at the child
            for i in through:
                s = stops[i]
                if len(s) > d:
                    ch = s[d]
                    group = groups.get(ch)
                    if group is None:
                        groups[ch] = [i]
                    else:
                        group.append(i)
                    if len(s) == d + 1:
                        ends.add(ch)
        kids: dict[str, int] = {}
        children, fail = self.children, self.fail
        for ch, ids in groups.items():
            f = ROOT
            if x != ROOT:  # the longest proper suffix of x's string + ch that is a node
                f = fail[x]
                while True:
                    nxt = children[f].get(ch)  # made: f is on x's failure chain
                    if nxt is not None:
                        f = nxt
                        break
                    if f == ROOT:
                        break
                    f = fail[f]
            kids[ch] = len(children)
            children.append(None)
            fail.append(f)
            self.depth.append(d + 1)
            self.longest.append(d + 1 if ch in ends else self.longest[f])
            self.through.append(ids)
        children[x] = kids
        self.through[x] = None  # no longer needed


class StopMatcher:
    """One stream's stop matching (see the module docstring). `steps` counts the work done:
    transitions, failure links followed and the automaton's node making (tests bound it)."""

    def __init__(self, stops):
        self.empty = "" in stops   # an empty stop is found at once (the text ends before it starts)
        stops = [s for s in stops if s != ""]
        self.automaton = StopAutomaton(stops) if stops else None
        self.state = ROOT
        self.pending = ""       # held back: could still be the start of a stop
        self.stopped = False
        self._steps = 0

    @property
    def steps(self) -> int:
        return self._steps + (self.automaton.built if self.automaton is not None else 0)

    def push(self, piece: str, final: bool = False) -> str:
        """The text `piece` releases (with what was held). `final`: nothing follows, so nothing is
        held. When a stop is found, `stopped` is set and the text ends where it begins."""
        buf = self.pending + piece
        if self.empty:
            self.pending, self.stopped = "", True
            return ""
        a = self.automaton
        if a is None:
            self.pending = ""
            return buf
        children, fail, longest, expand = a.children, a.fail, a.longest, a.expand
        u, steps, cut = self.state, len(piece), -1
        for j, ch in enumerate(piece, len(self.pending)):
            while True:
                kids = children[u]
                v = (kids if kids is not None else expand(u)).get(ch)
                if v is not None or u == ROOT:
                    break
                u = fail[u]
                steps += 1
            u = ROOT if v is None else v
            n = longest[u]
            if n and (cut < 0 or j + 1 - n < cut):
                cut = j + 1 - n
        self._steps += steps
        if cut >= 0:
            self.pending, self.stopped, self.state = "", True, ROOT
            return buf[:cut]
        self.state = u
        if final:
            self.pending = ""
            return buf
        hold = a.depth[u]
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]
