"""`ds4-torch bench stops`: the stop-string matcher (`serve.engine.stops`) against the plain scan it replaced.

1. The matcher alone: microseconds per token (a 4-character piece, the nodes the automaton makes
   on the way included) and its steps per character, for stops of 10, 100 and 1,000 characters,
   1, 16 and 64 of them (`adversarial_stops`: long common prefixes with the text, so the held
   tail stays long), next to the plain scan (`naive_stop_push`: for every stop, every prefix
   length tried against the held text, stops x length^2 per piece). The automaton's cost stays
   flat in the stop length.
2. Through the server (`--gap`, the default model): the median inter-token gap of a greedy stream
   alone, then beside a request without stops, and beside one with 64 stops of 1,000 characters
   built from its own greedy reply (63 shifted copies, then one it follows for 999 characters:
   the held text grows to 999 characters), matched by the automaton and by the plain scan. The
   target: beside the stops, within 1.5x of alone.
"""
from __future__ import annotations

import statistics
import threading
import time


def naive_stop_push(stops, pending: str, piece: str, final: bool) -> tuple[str, str, bool]:
    """The plain scan (the server's matcher before the automaton; tests' reference): (text
    released, text held back, stopped) after `piece` with `pending` held."""
    buf = pending + piece
    if stops:
        hits = [i for i in (buf.find(s) for s in stops) if i >= 0]
        if hits:
            return buf[:min(hits)], "", True
    if final or not stops:
        return buf, "", False
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(buf)), hold, -1):
            if buf.endswith(s[:k]):
                hold = k
                break
    return buf[:len(buf) - hold], buf[len(buf) - hold:] if hold else "", False


def adversarial_stops(count: int, length: int) -> list[str]:
    """`count` stops of `length` characters against the text ("a" * (length - 2) + "b") repeated,
    never completed (they end in "c"): "a" runs of every length, shortest first, then "b" (the
    automaton follows them deep and back along failure links), the last one "a" * (length - 1)
    (the held text grows to length - 2 characters; the plain scan tries every prefix length of
    every stop before it against it)."""
    runs = [(i * (length - 2)) // max(1, count - 1) for i in range(count - 1)]
    return [("a" * r + "b" + "a" * (length - 3 - r) + "c")[:length] for r in runs] + ["a" * (length - 1) + "c"]


class _Naive:
    """The plain scan behind `StopMatcher`'s interface (to run the server with it)."""

    def __init__(self, stops):
        self.stops, self.pending, self.stopped = list(stops), "", False

    def push(self, piece: str, final: bool = False) -> str:
        out, self.pending, stopped = naive_stop_push(self.stops, self.pending, piece, final)
        self.stopped = self.stopped or stopped
        return out


def matcher_table(lengths=(10, 100, 1000), counts=(1, 16, 64), tokens: int = 500, bar=None) -> list[dict]:
    """Per cell: the automaton's microseconds per token (its nodes made on the way included) and
    steps per character, and the plain scan's microseconds per token, over the same tokens."""
    from serve.engine.stops import StopMatcher

    rows = []
    for length in lengths:
        text = ("a" * (length - 2) + "b") * (1 + 4 * tokens // (length - 1))
        pieces = [text[i:i + 4] for i in range(0, 4 * tokens, 4)]
        for count in counts:
            stops = adversarial_stops(count, length)
            m = StopMatcher(stops)
            t0 = time.perf_counter()
            for p in pieces:
                m.push(p)
            new_us = 1e6 * (time.perf_counter() - t0) / len(pieces)
            naive = _Naive(stops)
            t0 = time.perf_counter()
            for p in pieces:
                naive.push(p)
            naive_us = 1e6 * (time.perf_counter() - t0) / len(pieces)
            rows.append({"stop_chars": length, "stops": count, "us_per_token": new_us,
                         "steps_per_char": m.steps / (4 * len(pieces)), "naive_us_per_token": naive_us})
            if bar is not None:
                bar.update()
    return rows


def _stream(url: str, prompt: str, n: int, stop=None) -> list[float]:
    """Arrival times of a greedy stream's tokens."""
    import json

    import httpx

    body = {"model": "bench", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, **({"stop": stop} if stop else {})}
    stamps = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                stamps.append(time.perf_counter())
    return stamps


def _gap_ms(stamps: list[float]) -> float:
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return 1000 * statistics.median(gaps) if gaps else float("nan")


def gap_table(tokens: int, beside_tokens: int) -> list[dict]:
    import httpx

    from .report import progress

    import serve.engine.output
    from ds4_torch.default_model import build_default_model, default_tokenizer
    from serve.http.app import ServerConfig, create_app
    from serve.background import BackgroundServer

    app = create_app(build_default_model(), default_tokenizer(), ServerConfig(model_name="bench", ctx=4096))
    rows = []
    bar = progress(5, "bench stops: the gaps", unit="stream")  # the reply, alone, then beside 3 requests
    with BackgroundServer(app) as srv, bar:
        long_prompt = "Write out the whole of the first act, every line."
        r = httpx.post(srv.url + "/v1/completions", timeout=600, json={
            "model": "bench", "prompt": long_prompt, "max_tokens": beside_tokens, "temperature": 0,
            "ignore_eos": True})
        reply = r.json()["choices"][0]["text"]
        bar.update()
        # 63 shifted copies of its reply, then one it follows for up to 999 characters (last: the
        # plain scan tries every prefix of the others against the held text first): never completed.
        stops = [(reply[i:i + 999] + "\x07" * 1000)[:1000] for i in range(1, 64)] + [reply[:999] + "\x07"]
        prompt = "Now is the winter of our discontent"
        alone = _gap_ms(_stream(srv.url, prompt, tokens))
        bar.update()
        for name, side_stops in (("no stops", None), ("automaton", stops), ("plain scan", stops)):
            real = serve.engine.output.StopMatcher
            if name == "plain scan":
                serve.engine.output.StopMatcher = _Naive
            output = app.state.engine.output
            cpu0 = output.cpu_s
            try:
                side = threading.Thread(target=_stream, args=(srv.url, long_prompt, beside_tokens, side_stops))
                side.start()
                time.sleep(0.5)  # its stream under way
                beside = _gap_ms(_stream(srv.url, prompt, tokens))
                side.join()
            finally:
                serve.engine.output.StopMatcher = real
            output.flush(10)
            bar.update()
            rows.append({"beside": name, "gap_alone_ms": alone, "gap_beside_ms": beside, "ratio": beside / alone,
                         "output_us_per_token": 1e6 * (output.cpu_s - cpu0) / (tokens + beside_tokens),
                         "reply_chars": len(reply)})
    return rows


def run(args) -> int:
    from .report import progress, write_csv

    with progress(9, "bench stops: the matcher", unit="cell") as bar:  # 3 stop lengths x 3 counts
        rows = matcher_table(tokens=args.tokens, bar=bar)
    print("stop matcher, adversarial stops (4-character tokens): the automaton vs the plain scan")
    print(f"{'stop chars':>10} {'stops':>6} {'us/token':>9} {'steps/char':>11} {'plain scan us/token':>20}")
    for r in rows:
        print(f"{r['stop_chars']:>10} {r['stops']:>6} {r['us_per_token']:>9.2f} {r['steps_per_char']:>11.2f} "
              f"{r['naive_us_per_token']:>20.1f}")
    if args.csv:
        write_csv(rows, args.csv)
    if args.gap:
        print("\na greedy stream's median inter-token gap beside a request without stops, and with 64 stops of "
              "1,000 characters matched by the automaton and by the plain scan (target: within 1.5x of alone), "
              "and the output thread's CPU per token of both streams (what the matcher holds the GIL for)")
        for r in gap_table(args.gap_tokens, args.beside_tokens):
            print(f"beside a request with {r['beside']:>10}: {r['gap_beside_ms']:6.2f} ms ({r['ratio']:.2f}x alone: "
                  f"{r['gap_alone_ms']:.2f} ms); output thread CPU {r['output_us_per_token']:.0f} us/token")
    return 0


def add_arguments(p) -> None:
    from ..runtime import positive_int

    p.add_argument("--tokens", type=positive_int, default=500,
                   help="4-character tokens pushed per cell (default 500: two passes of the 1,000-character text)")
    p.add_argument("--gap", action="store_true", help="also measure inter-token gaps through the server")
    p.add_argument("--gap-tokens", type=positive_int, default=100, help="tokens of the measured stream")
    p.add_argument("--beside-tokens", type=positive_int, default=400, help="tokens of the request with the stops")
    p.add_argument("--csv", metavar="FILE", help="also write the matcher table as CSV")
