"""One client cannot hurt another (issue #20): a request whose settings or serving raise fails
alone, in its API's error shape, and frees its session; the batch and the other requests go on.

Through HTTP, except the shutdown race (the engine directly). A failure inside the engine is
injected by wrapping the sampler the engine calls so that it raises for requests carrying a marker
setting (a stand-in for any bug or hostile value reaching sampling, penalties, grammar or
detokenizing).
"""
from __future__ import annotations

import json
import threading

import httpx
import pytest

import serve.engine.loop
from ds4_torch.generation import generate
from ds4_torch.sampling import BatchSampler
from ds4_torch.tokenizer import StreamDecoder
from serve.engine.loop import Engine, GenRequest
from helpers import server, wait_for

MODEL = "ds4-default"
CHUNK = 32
HOSTILE_TOP_K = 13        # requests with this top_k raise at their first token
HOSTILE_LATE_TOP_K = 17   # ... at their third token (inside a batched decode step)
TIMEOUT = 60              # a request left unanswered fails the test instead of hanging it


@pytest.fixture(scope="module")
def srv():
    with server(ctx=512, prefill_chunk=CHUNK) as s:
        yield s


@pytest.fixture
def raising_sampler(monkeypatch):
    """The engine's batched sampler raises when any of its rows is a hostile request's (the engine
    then draws row by row, and only those rows raise)."""
    real = BatchSampler.sample

    def sample(self, logits, *args, slots=None, **kw):
        rows = range(logits.shape[0]) if slots is None else [int(s) for s in slots]
        for s in rows:
            params = self.params[s]
            if params is not None and (params.top_k == HOSTILE_TOP_K or (
                    params.top_k == HOSTILE_LATE_TOP_K and int(self.generated[s]) >= 2)):
                raise RuntimeError("injected sampler failure")
        return real(self, logits, *args, slots=slots, **kw)

    monkeypatch.setattr(BatchSampler, "sample", sample)


def chat(srv, content, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 16,
            "temperature": 0, **kw}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)


def alone(model, tok, prompt, n):
    """The greedy text of `prompt` as `ds4_torch.generate` gives it, no other request beside it."""
    sd = StreamDecoder(tok)
    return "".join(sd.push(t) for t in generate(model, tok.encode(prompt), n, prefill_chunk=CHUNK)) + sd.flush()


def stream_text(srv, prompt, max_tokens, out: dict) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, finish = [], None
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"]
                for c in chunk.get("choices", []):
                    text.append(c["text"])
                    finish = c.get("finish_reason") or finish
    out["text"], out["finish"] = "".join(text), finish


def test_hostile_sampling_values_are_bounded(srv):
    """A temperature that would overflow the logits samples greedily (a 200, the greedy text); a
    repetition penalty outside its range is a 400 naming it."""
    greedy = chat(srv, "Hail, noble lord")
    tiny = chat(srv, "Hail, noble lord", temperature=1e-45)
    assert greedy.status_code == tiny.status_code == 200
    assert tiny.json()["choices"][0]["message"]["content"] == greedy.json()["choices"][0]["message"]["content"]
    for bad in (1e-30, 1000.0):
        r = chat(srv, "Hail, noble lord", repetition_penalty=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "Hail", "max_tokens": 4,
                                                       "temperature": 1e-45, "seed": 1}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_a_request_that_raises_fails_alone(srv, model, tok, raising_sampler):
    """Requests that raise at their first token or mid-batch get a 500 in their API's shape; a
    stream decoding beside them ends with exactly its text alone; 20 such requests in a row leak
    no session, and a normal request afterwards is served."""
    prompt, n = "Now is the winter of our discontent", 40
    want = alone(model, tok, prompt, n)
    engine = srv.app.state.engine
    engine.token_delay = 0.01  # keep the stream decoding while the hostile requests come and go
    try:
        out = {}
        beside = threading.Thread(target=stream_text, args=(srv, prompt, n, out))
        beside.start()
        for top_k in (HOSTILE_TOP_K, HOSTILE_LATE_TOP_K, HOSTILE_TOP_K):
            r = chat(srv, "Speak, what say you?", top_k=top_k, ignore_eos=True)
            assert r.status_code == 500, r.text
            error = r.json()["error"]
            assert error["code"] == "internal_error" and "injected sampler failure" in error["message"]
        r = httpx.post(srv.url + "/v1/messages", json={
            "model": MODEL, "max_tokens": 8, "top_k": HOSTILE_TOP_K,
            "messages": [{"role": "user", "content": "Who goes there?"}]}, timeout=TIMEOUT)
        assert r.status_code == 500 and r.json()["type"] == "error", r.text
        assert "injected sampler failure" in r.json()["error"]["message"]
        beside.join(TIMEOUT)
    finally:
        engine.token_delay = 0.0
    assert not beside.is_alive()
    assert out == {"status": 200, "text": want, "finish": "length"}

    # More hostile requests than there are sessions: each is answered and frees its session.
    for i in range(20):
        r = chat(srv, f"Knock, knock {i}", top_k=HOSTILE_TOP_K)
        assert r.status_code == 500, (i, r.text)
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": n,
                                                       "temperature": 0, "ignore_eos": True}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    assert srv.app.state.engine.health() is None


def test_chat_n_above_the_queue_is_a_400_naming_n(srv, monkeypatch):
    """n choices are queued together: more than the queue holds can never be served (a 400), while
    n up to it is."""
    monkeypatch.setattr(srv.app.state.config, "max_queue", 2)
    monkeypatch.setattr(srv.app.state.engine, "max_queue", 2)
    r = chat(srv, "Hail", n=3, max_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    r = chat(srv, "Hail", n=2, max_tokens=2)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


class _StopsTheServer:
    """A disk store whose restore (run while a request is being admitted, after it left the queue
    and before it is prefilling) stops the engine from another thread, as a shutdown would."""
    every = 0

    def __init__(self):
        self.engine = None

    def restore(self, cache, prompt_ids, tenant=None):
        stopper = threading.Thread(target=self.engine.stop)
        stopper.start()
        wait_for(self._stopping, TIMEOUT, "stop() to begin")
        return None

    def _stopping(self) -> bool:
        try:
            self.engine.submit_all([])  # queues nothing; refused once stop() began
        except serve.engine.loop.EngineStopped:
            return True
        return False

    def prepare(self, cache, token_ids, last_logits, why, tenant=None):
        return None


def test_a_request_put_back_after_stop_is_answered(model, tok):
    """stop() answers what is queued and cancels what runs; a request between the two whose
    prefill then fails is put back in the queue by the retry: it must still be answered (503)."""
    store = _StopsTheServer()
    engine = Engine(model, tok, ctx=128, prefill_chunk=CHUNK, kv_store=store)
    store.engine = engine

    def failing_prefill(*args):
        raise RuntimeError("injected device error")

    engine.replica.prefill = failing_prefill
    engine.start()
    events = []
    req = GenRequest(tok.encode("Who is there?"), 4, emit=events.append)
    engine.submit(req)
    wait_for(req.finished, TIMEOUT, "the request to be answered")
    assert req.state == "failed" and events[-1][0] == "error"
    assert events[-1][1].status == 503 and events[-1][1].code == "server_shutting_down"
