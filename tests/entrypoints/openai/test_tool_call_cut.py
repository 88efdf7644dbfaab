"""A tool call cut by max_tokens (issue 44, item 3) is the same in every API, as in OpenAI's: kept
as far as it was generated (its arguments may not parse), with finish_reason "length" in chat
(whole or streamed) and, in the Responses API, status "incomplete" (max_output_tokens) with the
function_call item "incomplete". The scripted engine writes " w0 w1" for two tokens: arguments
that are no JSON, as a call cut mid-way."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.server_config import ServerConfig
from tests.entrypoints.openai.conftest import CHAT_TEMPLATE

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
NAMED = {"type": "function", "function": {"name": "lookup"}}
CUT = " w0 w1"


def test_chat_whole_streamed_and_responses_agree(fake_engine):
    config = ServerConfig(served_model_names=("fake-model",), chat_template=CHAT_TEMPLATE)
    with TestClient(build_app(fake_engine, config)) as c:
        body = {"messages": [{"role": "user", "content": "Go"}], "tools": [TOOL], "tool_choice": NAMED,
                "max_tokens": 2}
        choice = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        assert call["id"] and call["function"] == {"name": "lookup", "arguments": CUT}

        streamed, finish = {}, None
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for ch in json.loads(line[6:])["choices"]:
                    for d in ch["delta"].get("tool_calls") or []:
                        entry = streamed.setdefault(d["index"], {"name": None, "arguments": ""})
                        entry["name"] = entry["name"] or d["function"].get("name")
                        entry["arguments"] += d["function"].get("arguments") or ""
                    finish = ch["finish_reason"] or finish
        assert finish == "length" and streamed == {0: {"name": "lookup", "arguments": CUT}}

        resp = c.post("/v1/responses", json={"input": "Go", "tools": [{"type": "function", "name": "lookup"}],
                                             "tool_choice": {"type": "function", "name": "lookup"},
                                             "max_output_tokens": 2}).json()
        assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
        [item] = resp["output"]
        assert item["type"] == "function_call" and item["status"] == "incomplete"
        assert (item["name"], item["arguments"]) == ("lookup", CUT)
