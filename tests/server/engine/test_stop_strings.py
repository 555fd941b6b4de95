"""Stop strings (serve/engine/stops.py, issue #33): the automaton releases and holds back exactly what
the plain scan it replaced did (`naive_stop_push`, the reference), on random texts and stop sets
over small alphabets (overlapping stops, stops across pieces, empty and multi-character pieces,
non-ASCII characters); its work per character does not grow with the stops' length; and a request
with 64 long adversarial stops gets the right text through HTTP."""
from __future__ import annotations

import random

import httpx
import pytest

from ds4_torch.bench.stops import adversarial_stops, naive_stop_push
from serve.engine.stops import StopAutomaton, StopMatcher


class Naive:
    def __init__(self, stops):
        self.stops, self.pending, self.stopped = stops, "", False

    def push(self, piece, final=False):
        out, self.pending, stopped = naive_stop_push(self.stops, self.pending, piece, final)
        self.stopped = self.stopped or stopped
        return out


def test_matches_the_plain_scan_on_random_streams():
    rng = random.Random(33)
    alphabets = ["a", "ab", "aab", "abc", "aé", "x😀y", "abcd"]
    for case in range(4000):
        alphabet = rng.choice(alphabets)
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 6))]
        if rng.random() < 0.1:
            stops.append(stops[0])  # a stop given twice
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 50)))
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(0, 5)
            pieces.append(text[i:i + n])
            i += n
        final = rng.random() < 0.5
        got, want = StopMatcher(stops), Naive(stops)
        for k, piece in enumerate(pieces):
            last = final and k == len(pieces) - 1
            assert got.push(piece, last) == want.push(piece, last), (case, stops, pieces, k)
            assert (got.pending, got.stopped) == (want.pending, want.stopped), (case, stops, pieces, k)
            if want.stopped:
                break


@pytest.mark.parametrize("stops,pieces,out", [
    (["abcd", "bc"], ["ab", "cd"], ["", ""]),        # both end in the same piece: the earlier start wins
    (["abcd", "bc"], ["abc", "d"], ["a"]),           # "bc" completes first: cut there
    (["xyz"], ["wx", "y", "q"], ["w", "", "xyq"]),   # held across pieces, then released
    (["é!"], ["caf", "é", "!x"], ["caf", "", ""]),  # a non-ASCII character in a stop spanning pieces
    ([""], ["abc"], [""]),                           # an empty stop ends the text before it starts
])
def test_examples(stops, pieces, out):
    m = StopMatcher(stops)
    assert [m.push(p) for p in pieces[:len(out)]] == out


@pytest.mark.parametrize("count", [1, 16, 64])
def test_work_per_character_does_not_grow_with_stop_length(count):
    """Adversarial stops (long common prefixes with the text, so the held tail stays long and the
    failure links are followed on every character) of length 10, 100 and 1,000: the steps per
    character stay bounded by a small constant (transitions, failure links and the nodes made),
    where the plain scan does stops x length^2 character comparisons per piece."""
    per_char = {}
    for length in (10, 100, 1000):
        stops = adversarial_stops(count, length)
        m = StopMatcher(stops)
        text = ("a" * (length - 2) + "b") * 4
        for i in range(0, len(text), 3):
            m.push(text[i:i + 3])
        assert not m.stopped
        per_char[length] = m.steps / len(text)
    assert max(per_char.values()) <= 2 + count, per_char  # two transitions amortized, node making
    assert per_char[1000] <= 1.5 * per_char[10] + 1, per_char


def test_nodes_are_made_only_where_the_text_goes():
    """64 stops of 1,000 characters sharing nothing: a text matching none of them deeply makes a
    few nodes, not 64,000."""
    rng = random.Random(5)
    stops = ["".join(rng.choice("abcdefgh") for _ in range(1000)) for _ in range(64)]
    m = StopMatcher(stops)
    for _ in range(200):
        m.push("".join(rng.choice("abcdefgh") for _ in range(4)))
    assert len(m.automaton.children) < 3000
    with pytest.raises(ValueError):
        StopAutomaton(["a", ""])


# --------------------------------------------------------------------------- through HTTP
@pytest.fixture(scope="module")
def srv():
    from helpers import server

    with server(ctx=512) as s:
        yield s


def complete(srv, stop, stream=False, n=48):
    body = {"model": "ds4-default", "prompt": "Now is the winter of our discontent", "max_tokens": n,
            "temperature": 0, "ignore_eos": True, "stop": stop}
    if not stream:
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
    import json

    text, finish = [], None
    with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:]).get("choices", []):
                    text.append(c["text"])
                    finish = c.get("finish_reason") or finish
    return "".join(text), finish


def test_sixty_four_long_adversarial_stops_through_http(srv):
    """63 stops of 1,000 characters that share long prefixes with the reply (each a piece of it
    followed by characters it never has) and one real stop in its middle: the reply ends exactly
    where that stop begins, streamed or not; without the real stop the whole reply comes back."""
    full, finish = complete(srv, None)
    assert finish == "length" and len(full) > 60
    at = len(full) // 2
    stop = full[at:at + 5]
    at = full.find(stop)
    decoys = [(full[i:i + 40 + i % 50] + "\x07" * 1000)[:1000] for i in range(63)]
    assert not any(d in full for d in decoys)
    assert complete(srv, decoys) == (full, "length")
    assert complete(srv, decoys + [stop]) == (full[:at], "stop")
    assert complete(srv, [stop] + decoys, stream=True) == (full[:at], "stop")
