"""The EAGLE-3 head's layer on bound kernel calls (worker/eagle_plan.py): an int8 target's head
drafts exactly what its modules draft, step for step, over the first pass on the target's rows,
chained drafts and catch-ups of several rows, with its final norm and LM head bound as well;
greedy output stays that of no speculation."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.worker import eagle_plan
from tests.spec_decode.test_eagle import GREEDY, _ids, _spy, _write_head
from tests.spec_decode.test_eagle3 import _engine, _head_config, _random_tensors
from tests.utils import make_tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="the plans run pagedllm's C kernels")


@pytest.mark.parametrize("arch,dtype,context", [("gemma3", "float32", False), ("llama", "bfloat16", False),
                                                ("gemma3", "float32", True)])
def test_head_plan_drafts_what_the_modules_draft(tmp_path, monkeypatch, arch, dtype, context):
    """With `context`, a draft vocabulary of 40 and the context's other tokens drafted too
    (spec_decode/context_tokens.py), on the plan's normed rows or the module's."""
    model = make_tiny_model(str(tmp_path / arch), arch, head_dim=32,
                            **({"query_pre_attn_scalar": 32} if arch == "gemma3" else {}))
    config = _head_config(model, draft_vocab=40 if context else None)
    tensors = _random_tensors(config, 7)
    if context:
        from transformers import AutoModelForCausalLM

        config["eagle_config"] = {"draft_context_tokens": True}
        embedding = AutoModelForCausalLM.from_pretrained(model).get_input_embeddings().weight.detach()
        draft_ids = (torch.arange(40) + tensors["d2t"]).tolist()
        tensors["lm_head.weight"] = embedding[draft_ids].clone()
    head = _write_head(str(tmp_path / "head"), config, tensors)
    rows, fused, logits = [], [], []
    real, real_logits = eagle_plan.Eagle3LayerPlan.run_layer, eagle_plan.Eagle3LayerPlan.draft_logits

    def run_layer(self, embeds, hidden, *args):
        rows.append(self.rows)
        fused.append(hidden.shape[-1] != embeds.shape[-1])
        return real(self, embeds, hidden, *args)

    def draft_logits(self, out):
        result = real_logits(self, out)
        logits.append(result is not None)
        return result

    monkeypatch.setattr(eagle_plan.Eagle3LayerPlan, "run_layer", run_layer)
    monkeypatch.setattr(eagle_plan.Eagle3LayerPlan, "draft_logits", draft_logits)
    reference = _ids(_engine(model, quantization="int8", dtype=dtype), GREEDY)
    llm = _engine(model, head, quantization="int8", dtype=dtype)
    with_plan = _spy(llm)
    assert _ids(llm, GREEDY) == reference
    assert max(rows) > 1 and any(fused) and not all(fused)  # catch-ups over the target's rows, chained drafts
    assert logits and all(logits)  # the final norm and LM head bound too
    monkeypatch.setattr(eagle_plan.Eagle3PlanRunner, "__call__", lambda self, *args: None)
    rows.clear()
    logits.clear()
    llm = _engine(model, head, quantization="int8", dtype=dtype)
    without = _spy(llm)
    assert _ids(llm, GREEDY) == reference
    assert not rows and not logits
    assert with_plan == without
    assert len(with_plan) > 20
    if context:
        assert any(set(drafts) - set(draft_ids) for _, drafts in with_plan)
