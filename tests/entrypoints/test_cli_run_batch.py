"""`pagedllm run-batch` on the tiny model: OpenAI's batch input to its output format, in input
order, every bad line its own error line and never the end of the run."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.cli.main import main
from tests.entrypoints.openai.conftest import CHAT_TEMPLATE

GREEDY = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 0}


def _line(custom_id, url: str, body, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def _run(tiny_llama, tmp_path, lines: list[str], *flags: str) -> list[dict]:
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    rc = main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), tiny_llama,
               "--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-memory", "16MiB",
               "--max-model-len", "256", "--chat-template", str(template), "--no-progress", *flags])
    assert rc == 0
    return [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]


def test_batch_with_good_and_bad_lines(tiny_llama, tmp_path):
    lines = [
        _line("chat", "/v1/chat/completions", CHAT),
        _line("cmpl-a", "/v1/completions", GREEDY),
        "{not json",
        _line("url", "/v1/unknown", GREEDY),
        _line("embed", "/v1/embeddings", {"model": "tiny", "input": "Hello"}),
        _line("negative", "/v1/completions", {**GREEDY, "max_tokens": -3}),
        _line("model", "/v1/completions", {**GREEDY, "model": "nope"}),
        _line("stream", "/v1/completions", {**GREEDY, "stream": True}),
        _line("get", "/v1/completions", GREEDY, method="GET"),
        _line(7, "/v1/completions", GREEDY),
        _line("body", "/v1/completions", "a string"),
        "",  # blank lines are skipped
        _line("responses", "/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 4,
                                             "temperature": 0}),
        *[_line(f"cmpl-{i}", "/v1/completions", GREEDY) for i in range(6)],
    ]
    out = _run(tiny_llama, tmp_path, lines, "--max-concurrency", "3")
    assert [o["custom_id"] for o in out] == ["chat", "cmpl-a", None, "url", "embed", "negative", "model", "stream",
                                             "get", 7, "body", "responses", *[f"cmpl-{i}" for i in range(6)]]
    assert all(o["id"].startswith("batch_req_") for o in out) and len({o["id"] for o in out}) == len(out)
    by_id = {o["custom_id"]: o for o in out}

    def status(cid):
        return by_id[cid]["response"]["status_code"] if by_id[cid]["response"] else None

    chat = by_id["chat"]["response"]
    assert chat["status_code"] == 200 and chat["request_id"] and by_id["chat"]["error"] is None
    assert chat["body"]["object"] == "chat.completion" and chat["body"]["usage"]["completion_tokens"] <= 5
    cmpl = by_id["cmpl-a"]["response"]["body"]
    assert cmpl["choices"][0]["finish_reason"] == "length" and cmpl["usage"]["completion_tokens"] == 6
    # every copy of the greedy request, run concurrently, gives the same text
    assert {by_id[f"cmpl-{i}"]["response"]["body"]["choices"][0]["text"] for i in range(6)} == {
        cmpl["choices"][0]["text"]}
    assert by_id["responses"]["response"]["body"]["object"] == "response"
    # the server's own error lines: status code and error body
    assert status("embed") == 400 and "pooling" in by_id["embed"]["response"]["body"]["error"]["message"]
    assert status("negative") == 400 and by_id["negative"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert status("model") == 404
    # lines that never reach the server: `error` set, no response
    for o in out:
        if o["custom_id"] in (None, "url", "stream", "get", 7, "body"):
            assert o["response"] is None and o["error"]["message"], o
    assert by_id[None]["error"]["code"] == "invalid_json"
    assert "url must be one of" in by_id["url"]["error"]["message"]
    assert "stream" in by_id["stream"]["error"]["message"]


def test_embeddings_with_a_pooling_model(tiny_llama, tmp_path):
    lines = [_line("e1", "/v1/embeddings", {"model": "tiny", "input": ["Hello", "The quick brown fox"]}),
             _line("c1", "/v1/completions", GREEDY)]
    e1, c1 = _run(tiny_llama, tmp_path, lines, "--runner", "pooling")
    body = e1["response"]["body"]
    assert e1["response"]["status_code"] == 200 and [d["index"] for d in body["data"]] == [0, 1]
    assert len(body["data"][0]["embedding"]) == 64  # the tiny model's hidden size
    assert c1["response"]["status_code"] == 400  # and a pooling model does not generate


def test_unreadable_input_is_a_clear_error(tmp_path, capsys):
    assert main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["run-batch", "-o", "o.jsonl"], ["run-batch", "-i", "i.jsonl"]])
def test_input_and_output_are_required(argv):
    with pytest.raises(SystemExit):
        main(argv)
