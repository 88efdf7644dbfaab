"""The per-step sampling metadata the runner builds from scheduled requests: static bias and
allowed tokens, stop ids banned before min_tokens, bad-word endings, and top_k >= vocab as off."""

from __future__ import annotations

import torch

from pagedllm.core.sched_output import NewRequestData, SchedulerOutput
from pagedllm.model_executor.layers.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch, StepRow
from pagedllm.worker.sampling_metadata import SamplingMetadataBuilder

NEG_INF = float("-inf")


def _rows(*requests: tuple[SamplingParams, list[int]]) -> tuple[InputBatch, list[StepRow]]:
    """Requests with prompt [7, 8] and the given output so far, each at its next token."""
    batch = InputBatch()
    new = [NewRequestData(str(i), [7, 8], p, [0], 1 + len(out), output_token_ids=out)
           for i, (p, out) in enumerate(requests)]
    return batch, batch.update_states(SchedulerOutput(scheduled_new_reqs=new,
                                                      num_scheduled_tokens={n.req_id: 1 for n in new}))


def _build(vocab: int, *requests: tuple[SamplingParams, list[int]]):
    batch, rows = _rows(*requests)
    return SamplingMetadataBuilder(vocab, torch.device("cpu"), batch).build(rows)


def test_metadata_builder_static_bias_and_allowed_tokens():
    params = SamplingParams(temperature=0, allowed_token_ids=[1, 4], logit_bias={4: -2.5, 0: 9.0})
    md = _build(6, (params, []))
    bias = md.static_bias[0]
    assert bias.tolist() == [NEG_INF, 0.0, NEG_INF, NEG_INF, -2.5, NEG_INF]  # 0 is not allowed, bias or not
    params = SamplingParams(temperature=0, logit_bias={2: 1.5})
    md = _build(4, (params, []))
    assert md.static_bias[0].tolist() == [0.0, 0.0, 1.5, 0.0]


def test_metadata_builder_bans_stop_ids_before_min_tokens_and_bad_word_endings():
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=5)
    params.all_stop_token_ids = {2, 5}
    params.bad_words_token_ids = [[9], [3, 4, 6]]
    def banned(output):
        return sorted(_build(10, (params, output)).banned_token_ids.get(0, []))

    assert banned([]) == [2, 5, 9]
    assert banned([3]) == [2, 5, 9]  # only one token of the prefix [3, 4] so far
    assert banned([0, 3, 4]) == [6, 9]  # min_tokens reached; the prefix is complete → its last token
    assert banned([3, 4, 0]) == [9]
    assert banned([0, 4]) == [9]
    assert banned([3, 4]) == [6, 9]
    assert banned([1, 3, 0, 4]) == [9]


def test_top_k_at_least_vocab_is_off():
    """vLLM treats top_k >= vocab as off; it must not reach topk() with k > vocab."""
    params = [SamplingParams(temperature=1.0, top_k=k, seed=3) for k in (1000, 5, 2)]
    batch, rows = _rows(*[(p, []) for p in params])
    md = SamplingMetadataBuilder(5, torch.device("cpu"), batch).build(rows)
    assert md.top_k.tolist() == [0, 0, 2]
    md = SamplingMetadataBuilder(5, torch.device("cpu"), batch).build(rows[:2])
    assert md.top_k is None
    logits = torch.randn(2, 5)
    assert Sampler(torch.Generator().manual_seed(0))(logits, md).sampled_token_ids.shape == (2,)
