"""What a router in front of several replicas asks a replica besides generation (vLLM's
endpoints of the same names, which vllm-router's kv_aware policy calls): the token ids a request
would prefill (POST /v1/chat/completions/render, /v1/completions/render, /v1/responses/render:
the router hashes them to find the replica holding most of them), and this run's identity and KV
block size (GET /get_server_info). Each render is checked against the prompt ids the request
itself reports (`return_token_ids`) or counts (usage)."""
from __future__ import annotations

import httpx

from helpers import MODEL, server

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                          "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                                                         "required": ["word"]}}}]


def test_render_gives_the_ids_each_api_prefills(model):
    chat = {"model": MODEL, "messages": [{"role": "system", "content": "You are terse."},
                                         {"role": "user", "content": "Define the word 'stage'."}],
            "tools": TOOLS, "max_tokens": 3, "temperature": 0}
    with server(model, ctx=1024) as srv:
        rendered = httpx.post(srv.url + "/v1/chat/completions/render", json=chat)
        assert rendered.status_code == 200, rendered.text
        asked = httpx.post(srv.url + "/v1/chat/completions", json={**chat, "return_token_ids": True}).json()
        assert rendered.json()["token_ids"] == asked["prompt_token_ids"]
        # without the tools the prompt differs: the render follows the request
        plain = httpx.post(srv.url + "/v1/chat/completions/render", json={**chat, "tools": []}).json()["token_ids"]
        assert plain != asked["prompt_token_ids"]

        both = {"model": MODEL, "prompt": ["a stage", [5, 6, 7]], "max_tokens": 2, "return_token_ids": True}
        rendered = httpx.post(srv.url + "/v1/completions/render", json=both).json()
        asked = httpx.post(srv.url + "/v1/completions", json=both).json()
        assert [r["token_ids"] for r in rendered][1] == [5, 6, 7]
        assert [len(r["token_ids"]) for r in rendered] == [len(c["prompt_token_ids"]) for c in asked["choices"]]

        resp = {"model": MODEL, "instructions": "You are terse.", "input": "Define the word 'stage'.",
                "max_output_tokens": 3}
        rendered = httpx.post(srv.url + "/v1/responses/render", json=resp).json()["token_ids"]
        assert len(rendered) == httpx.post(srv.url + "/v1/responses", json=resp).json()["usage"]["input_tokens"]

        bad = httpx.post(srv.url + "/v1/chat/completions/render", json={"model": MODEL, "messages": "hi"})
        assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]


def test_server_info_names_the_model_this_run_and_the_block_size(model):
    with server(model, ctx=256, kv_block_tokens=32, api_key="k") as srv:
        info = httpx.get(srv.url + "/get_server_info").json()  # open, as /health: the router asks without a key
        assert httpx.post(srv.url + "/v1/chat/completions/render", json={"messages": []}).status_code == 401
        assert (info["model_id"], info["kv_block_size"], info["kv_events"]) == (MODEL, 32, False)
    with server(model, ctx=256) as srv:
        other = httpx.get(srv.url + "/get_server_info").json()
    assert other["instance_id"] != info["instance_id"]  # a restart is another run
