"""The code around attention on a CUDA GPU (skipped without one): the sampler's masks, bias,
penalties and logprobs equal to the CPU's; seeded draws independent of the batch; rejection
sampling and a draft model; the LoRA layer fed from host tensors; BERT pooling; dummy weights
drawn on the device."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import build_model_config
from pagedllm.core.sched_output import NewRequestData, SchedulerOutput
from pagedllm.forward_context import set_forward_context
from pagedllm.model_executor.layers.lora import LinearLoRA
from pagedllm.model_executor.layers.pooler import finish_vectors, pool
from pagedllm.model_executor.layers.sampler import Sampler, SamplingMetadata
from pagedllm.model_executor.loader.model_loader import get_model
from pagedllm.spec_decode.rejection_sampler import accept_sampled
from pagedllm.spec_decode.truncated_draft import make_truncated_draft
from pagedllm.worker.input_batch import InputBatch, StepRow
from pagedllm.worker.sampling_metadata import SamplingMetadataBuilder
from pagedllm.worker.step_inputs import prepare_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
VOCAB = 300


def _requests() -> tuple[InputBatch, list[StepRow]]:
    def req(req_id: str, output: list[int], **params) -> NewRequestData:
        return NewRequestData(req_id, [1, 2, 3], SamplingParams(temperature=0, logprobs=2, **params), [0],
                              2 + len(output), output_token_ids=output)

    new = [
        req("plain", [4, 4, 5]),
        req("penalties", [7, 7, 9], repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
        req("bias", [], logit_bias={5: 3.0, 6: -2.0}, allowed_token_ids=[5, 6, 7, 8]),
        req("min_tokens", [3], min_tokens=4, stop_token_ids=[11, 12]),
    ]
    batch = InputBatch()
    return batch, batch.update_states(SchedulerOutput(scheduled_new_reqs=new,
                                                      num_scheduled_tokens={n.req_id: 1 for n in new}))


def _metadata(device: torch.device):
    batch, rows = _requests()
    return SamplingMetadataBuilder(VOCAB, device, batch).build(rows)


def test_masks_bias_penalties_and_logprobs_equal_the_cpu():
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    cpu, gpu = (Sampler(torch.Generator(device=device).manual_seed(0))(  # a copy each: the sampler masks in place
        logits.to(device, copy=True), _metadata(device))
        for device in (CPU, CUDA))
    assert gpu.sampled_token_ids.tolist() == cpu.sampled_token_ids.tolist()
    assert gpu.logprob_token_ids.tolist() == cpu.logprob_token_ids.tolist()
    assert gpu.sampled_ranks.tolist() == cpu.sampled_ranks.tolist()
    torch.testing.assert_close(gpu.logprobs.cpu(), cpu.logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k", [0, 20])
def test_seeded_rows_do_not_depend_on_the_batch(top_k):
    def draw(logits: torch.Tensor, row: int) -> int:
        n = logits.shape[0]
        md = SamplingMetadata(
            temperature=torch.full((n,), 0.9, device=CUDA),
            top_k=torch.full((n,), top_k, device=CUDA) if top_k else None, top_p=None,
            greedy=torch.zeros(n, dtype=torch.bool, device=CUDA), all_greedy=False,
            generators={row: torch.Generator(device=CUDA).manual_seed(42)},
        )
        return int(Sampler(torch.Generator(device=CUDA).manual_seed(7))(logits, md).sampled_token_ids[row])

    torch.manual_seed(0)
    logits = torch.randn(1, 5000, device=CUDA)
    batch = torch.cat([torch.randn(3, 5000, device=CUDA), logits, torch.randn(2, 5000, device=CUDA)])
    assert draw(logits, 0) == draw(batch, 3)


def test_rejection_sampling_on_the_device():
    torch.manual_seed(0)
    q = torch.softmax(torch.randn(3, 50, device=CUDA), -1)
    p = torch.softmax(torch.randn(4, 50, device=CUDA), -1)
    drafts = q.argmax(-1).tolist()
    gen = torch.Generator(device=CUDA).manual_seed(0)
    out = accept_sampled(drafts, [1, 2, 3, 4], p, q, gen)
    assert 1 <= len(out) <= 4 and out[:-1] == drafts[: len(out) - 1]
    same = torch.cat([q, p[3:]])  # p == q at every draft: all accepted, then the bonus token
    assert accept_sampled(drafts, [1, 2, 3, 4], same, q, gen) == drafts + [4]


def test_draft_model_speculation_on_the_device(tiny_llama, tmp_path):
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], list(range(40, 60)), [12, 13, 12, 13], [30, 31, 32]]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(tiny_llama, dtype="float32", device="cuda", kv_cache_memory=1 << 26, enforce_eager=True)
    want = plain.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    del plain
    spec = {"method": "draft_model", "model": make_truncated_draft(tiny_llama, str(tmp_path / "draft"), 2),
            "num_speculative_tokens": 3}
    llm = LLM(tiny_llama, dtype="float32", device="cuda", kv_cache_memory=1 << 26, speculative_config=spec)
    params = [greedy,
              SamplingParams(temperature=0.9, top_k=5, max_tokens=16, ignore_eos=True, seed=1),
              SamplingParams(temperature=0.9, top_p=0.8, max_tokens=16, ignore_eos=True, seed=2),
              SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, presence_penalty=0.5)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [16] * 4
    assert outs[0].outputs[0].token_ids == want


def test_lora_layer_from_host_tensors_equals_the_cpu():
    torch.manual_seed(0)
    slices = {"q": (0, 12), "k": (12, 4), "v": (16, 4)}
    slot0 = {"q": (torch.randn(2, 8), torch.randn(12, 2)), "k": (torch.randn(3, 8), torch.randn(4, 3))}
    slot1 = {"v": (torch.randn(4, 8), torch.randn(4, 4))}
    x, base = torch.randn(5, 8), torch.randn(5, 20)
    mask = (torch.tensor([0, -1, 1, 0, 1])[:, None] == torch.arange(2 * 4)[None, :] // 4).float()
    outs = []
    for device in (CPU, CUDA):
        lora = LinearLoRA(8, slices, max_loras=2, max_rank=4, dtype=torch.float32, device=device)
        lora.set_slot(0, slot0)  # adapters stay on the host (load_adapter); the slots are on the device
        lora.set_slot(1, slot1)
        outs.append(lora.apply(x.to(device), base.to(device), mask.to(device)).cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_bert_pools_on_the_device_as_on_the_cpu(tmp_path):
    from tests.pooling.test_pooling import _tiny_bert

    path = _tiny_bert(str(tmp_path))
    prompts = [[5, 17, 33, 2, 90], [44, 3], list(range(10, 70)), [7]]
    vectors = []
    for device in (CPU, CUDA):
        config = build_model_config(None, path, None, "float32", device, None, 0, False, quantization="none")
        model = get_model(config, device)
        step = prepare_inputs(prompts, [0] * 4, [[0, 1, 2, 3]] * 4, 16, device)
        with torch.inference_mode(), set_forward_context(step.attn_metadata):
            hidden = model(step.input_ids, step.positions)
        pooled = pool(hidden, step.cu_start, step.cu_end, "MEAN")
        vectors.append(finish_vectors(pooled, [True, False, True, False], [None, 16, None, 8]))
    assert [len(v) for v in vectors[1]] == [len(v) for v in vectors[0]] == [64, 16, 64, 8]
    for got, want in zip(vectors[1], vectors[0]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-4)


def test_dummy_weights_are_drawn_on_the_device(tiny_llama):
    config = build_model_config(None, tiny_llama, None, "bfloat16", CUDA, None, 0, False, quantization="none")
    config.load_format = "dummy"
    first, second = get_model(config, CUDA), get_model(config, CUDA)
    for (name, a), b in zip(first.named_parameters(), second.parameters()):
        assert a.device.type == "cuda" and a.dtype == torch.bfloat16, name
        assert torch.equal(a, b), name  # seeded
        assert 0 < float(a.abs().max()) <= 1.01e-3, name  # bf16 rounding of the 1e-3 bound
