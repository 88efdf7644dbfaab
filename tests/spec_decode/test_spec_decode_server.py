"""`pagedllm serve --speculative-config ...` (n-gram, and a head: EAGLE-3's): the same greedy text as
offline without speculation, streamed text equal to non-streamed, draft counters on /metrics, a
bad config refused at start. The other heads (EAGLE, Medusa, MTP) take the same path from the flag
to the runner as EAGLE-3's; their drafting is checked offline (test_eagle.py, test_medusa.py, test_mtp.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest

from pagedllm import LLM, SamplingParams
from tests.entrypoints.openai.serve_utils import API_KEY, AUTH, MODEL, read_metrics, serve_tiny
from tests.spec_decode.test_eagle3 import _constant_head

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})


EAGLE_TOKEN = 77  # the EAGLE-3 head always drafts it; the requests' logit_bias makes the target say it


@pytest.fixture(scope="module", params=["ngram", "eagle3"])
def spec_server(request, tiny_llama, tmp_path_factory):
    """The server's URL and the logit bias its requests carry."""
    spec, bias = NGRAM, {}
    if request.param == "eagle3":
        head = _constant_head(tiny_llama, str(tmp_path_factory.mktemp("eagle3")), EAGLE_TOKEN)
        spec, bias = json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": 3}), {EAGLE_TOKEN: 100.0}
    for url in serve_tiny(tiny_llama, tmp_path_factory, extra_args=("--speculative-config", spec)):
        yield url, bias


def test_served_speculation_matches_offline_greedy(spec_server, tiny_llama):
    spec_server, bias = spec_server
    client = openai.OpenAI(base_url=f"{spec_server}/v1", api_key=API_KEY, max_retries=0)
    params = dict(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, logprobs=1, extra_body={"ignore_eos": True},
                  logit_bias={str(t): b for t, b in bias.items()})
    full = client.completions.create(**params)
    offline = LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 24).generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logit_bias=bias),
        use_tqdm=False)[0].outputs[0]
    assert full.choices[0].text == offline.text
    assert len(full.choices[0].logprobs.tokens) == 32 and full.usage.completion_tokens == 32
    streamed = "".join(c.choices[0].text for c in client.completions.create(**params, stream=True) if c.choices)
    assert streamed == offline.text
    m = read_metrics(spec_server)
    assert m["pagedllm:spec_decode_num_draft_tokens_total"] > 0
    assert m["pagedllm:spec_decode_num_accepted_tokens_total"] > 0
    assert 0 < m["pagedllm:spec_decode_acceptance_rate"] <= 1
    first = [line for line in httpx.get(f"{spec_server}/metrics", headers=AUTH).text.splitlines()
             if line.startswith("pagedllm:spec_decode_num_accepted_tokens_per_pos_total{") and 'position="0"' in line]
    assert len(first) == 1 and float(first[0].rsplit(" ", 1)[1]) > 0


def test_bad_speculative_config_is_refused_at_start(tiny_llama):
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", tiny_llama, "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 0}'],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "num_speculative_tokens must be an integer >= 1" in proc.stderr
