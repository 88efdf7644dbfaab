"""`pagedllm serve --device cuda` as a real process, driven by the openai SDK: completions,
streamed chat, JSON-schema outputs, and a 400 for bad input (skipped without a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.entrypoints.openai.serve_utils import API_KEY, MODEL, serve_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(tiny_llama, tmp_path_factory):
    for url in serve_tiny(tiny_llama, tmp_path_factory, extra_args=("--device", "cuda")):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)


def test_completions_chat_and_schema(client):
    done = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=8, temperature=0)
    assert done.usage.completion_tokens == 8 and done.choices[0].text
    again = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=8, temperature=0)
    assert again.choices[0].text == done.choices[0].text
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=6, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A number"}],
                                         max_tokens=40, response_format={"type": "json_schema", "json_schema": {
                                             "name": "n", "schema": schema}}, extra_body={"logit_bias": None})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content)["n"], int)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
