"""Loopback is not a door for web pages (serve/http/guard.py): a POST must be JSON (415 otherwise), a
server bound to loopback answers loopback Host names and --allowed-hosts only (421 otherwise),
and browsers get CORS headers only for --cors-origins. The official SDKs pass all of it."""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from serve.http.guard import host_name, is_json_type, is_loopback_name
from helpers import server

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
MESSAGES = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def srv(model, tok):
    with server(model, tok, ctx=512, allowed_hosts=("ds4.internal",)) as s:
        yield s


def test_names_and_types():
    assert all(map(is_loopback_name, ["localhost", "127.0.0.1", "127.3.4.5", "[::1]", "::1", "api.localhost"]))
    assert not any(map(is_loopback_name, ["evil.example", "10.0.0.1", "0.0.0.0", "localhost.evil.example", ""]))
    assert [host_name(h) for h in ("localhost:8000", "[::1]:80", "127.0.0.1", "::1")] == \
        ["localhost", "[::1]", "127.0.0.1", "::1"]
    assert is_json_type("application/json") and is_json_type("Application/JSON; charset=utf-8")
    assert is_json_type("application/vnd.api+json")
    assert not any(map(is_json_type, ["text/plain", "", "application/x-www-form-urlencoded", "multipart/form-data"]))


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_a_post_that_is_not_json_is_a_415_in_each_apis_shape(srv, ctype):
    import json
    headers = {"content-type": ctype} if ctype else {}
    r = httpx.post(srv.url + "/v1/chat/completions", content=json.dumps(CHAT), headers=headers)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = httpx.post(srv.url + "/v1/messages", content=json.dumps(MESSAGES), headers=headers)
    assert r.status_code == 415 and r.json()["type"] == "error"


def test_json_types_and_the_official_clients_pass(srv):
    import json
    for ctype in ("application/json", "application/json; charset=utf-8", "application/vnd.ds4+json"):
        assert httpx.post(srv.url + "/v1/chat/completions", content=json.dumps(CHAT),
                          headers={"content-type": ctype}).status_code == 200
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    assert oai.chat.completions.create(**CHAT).choices
    claude = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    assert claude.messages.create(**MESSAGES).content is not None


@pytest.mark.parametrize("host,status", [("evil.example", 421), ("evil.example:8000", 421), ("10.1.2.3", 421),
                                         ("localhost", 200), ("127.0.0.1:1", 200), ("[::1]:9", 200),
                                         ("ds4.internal", 200), ("DS4.internal:80", 200)])
def test_bound_to_loopback_only_loopback_hosts_and_allowed_hosts_answer(srv, host, status):
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers={"host": host})
    assert r.status_code == status, r.text
    if status == 421:
        assert r.json()["error"]["code"] == "misdirected_request"
        assert httpx.get(srv.url + "/v1/models", headers={"host": host}).status_code == 421


def test_no_cors_unless_origins_are_given(srv, model, tok):
    origin = {"origin": "http://evil.example"}
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers=origin)
    assert "access-control-allow-origin" not in r.headers
    with server(model, tok, ctx=512, cors_origins=("http://app.example",)) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json=CHAT, headers={"origin": "http://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        r = httpx.post(s.url + "/v1/chat/completions", json=CHAT, headers=origin)
        assert "access-control-allow-origin" not in r.headers


def test_a_server_bound_elsewhere_does_not_check_the_host(model, tok):
    with server(model, tok, ctx=512, host="0.0.0.0") as s:
        assert httpx.post(s.url + "/v1/chat/completions", json=CHAT, headers={"host": "ds4.lan"}).status_code == 200
