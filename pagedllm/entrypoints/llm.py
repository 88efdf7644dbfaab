"""`LLM`: the offline entry point (`LLM(model).generate(prompts, params)`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.processor import PromptType
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling_params import PoolingParams, cosine, cross_encoder_prompt, pair_up
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Keyword arguments are EngineArgs fields (model, dtype, max_model_len, ...)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise ValueError(f"unknown engine arguments: {sorted(unknown)}")
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_metrics(self) -> dict[str, float]:
        """The engine's counters and gauges under their /metrics names (`pagedllm:...`):
        KV usage, prefix cache, preemptions, speculative decoding (drafts, accepted tokens,
        acceptance rate, mean acceptance length)."""
        return {f"pagedllm:{name}": value for name, value in self.llm_engine.get_stats().items()}

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None: the base model) per prompt."""
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params if sampling_params is not None else SamplingParams(), prompts,
                             "sampling params")
        loras = _per_prompt(lora_request, prompts, "LoRA requests") if lora_request is not None else None
        for p in params:
            if isinstance(p, SamplingParams):
                p.output_kind = RequestOutputKind.FINAL_ONLY  # only the last output is returned (as vLLM)
        ids = self._submit(self.llm_engine.add_request, prompts, params, priority, loras)
        return self._run_engine(ids, use_tqdm)

    def _submit(self, add, prompts: list, params: list, priority: list[int] | None,
                loras: list[LoRARequest | None] | None = None) -> list[str]:
        """`add(request_id, prompt, params, priority=...)` for each prompt; their ids. A bad
        prompt aborts the ones already added, so none is left running."""
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
        ids: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                req_id = str(next(self._counter))
                extra = {"lora_request": loras[i]} if loras is not None and loras[i] is not None else {}
                add(req_id, prompt, p, priority=priority[i] if priority else 0, **extra)
                ids.append(req_id)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return ids

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[PoolingRequestOutput]:
        """The raw pooled hidden state of each prompt (the model's pooler: MEAN, CLS or LAST; not
        normalized unless `pooling_params` ask). Needs runner="pooling"."""
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(pooling_params if pooling_params is not None else PoolingParams(task="encode"), prompts,
                             "pooling params")
        ids = self._submit(self.llm_engine.add_pooling_request, prompts, params, priority)
        return self._run_engine(ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`); `pooling_params` may set
        `normalize`, `dimensions` (matryoshka models) and `truncate_prompt_tokens`."""
        params = pooling_params if pooling_params is not None else PoolingParams(task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in self.encode(prompts, params, use_tqdm)]

    def classify(
        self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities of each prompt (`.outputs.probs`) on a sequence-classification model."""
        model_config = self.llm_engine.config.model_config
        if not model_config.classify:
            raise ValueError(f"classify needs a sequence-classification model (not --convert embed); "
                             f"{model_config.architecture} is not one")
        params = PoolingParams(normalize=False, task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in self.encode(prompts, params, use_tqdm)]

    def score(
        self,
        text_1: PromptType | Sequence[PromptType],
        text_2: PromptType | Sequence[PromptType],
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """Cosine similarity of each pair's embeddings: one text_1 against every text_2, or the
        two lists pair by pair."""
        firsts, seconds = pair_up(_as_prompt_list(text_1), _as_prompt_list(text_2))
        if self.llm_engine.config.model_config.classify:
            return self._cross_encode(firsts, seconds, use_tqdm)
        unique = list(dict.fromkeys(map(_key, firsts + seconds)))
        by_key = dict(zip(unique, self.embed([_unkey(k) for k in unique], use_tqdm=use_tqdm)))
        outs = []
        for i, (a, b) in enumerate(zip(firsts, seconds)):
            ea, eb = by_key[_key(a)], by_key[_key(b)]
            outs.append(ScoringRequestOutput(str(i), ScoringOutput(cosine(ea.outputs.embedding, eb.outputs.embedding)),
                                             ea.prompt_token_ids + eb.prompt_token_ids))
        return outs

    def _cross_encode(self, firsts: list, seconds: list, use_tqdm: bool) -> list[ScoringRequestOutput]:
        """A cross-encoder (a classifier with one label) reads each pair at once: its sigmoid is the score."""
        if self.llm_engine.config.model_config.hf_config.num_labels != 1:
            raise ValueError("score on a classifier needs a cross-encoder: a model with a single label")
        tokenizer = self.get_tokenizer()
        prompts = [cross_encoder_prompt(tokenizer, a, b) for a, b in zip(firsts, seconds)]
        outs = self.encode(prompts, PoolingParams(normalize=False, task="classify"), use_tqdm)
        return [ScoringRequestOutput(str(i), ScoringOutput(o.outputs.data[0]), o.prompt_token_ids)
                for i, o in enumerate(outs)]

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in finished])
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Render one conversation or a list of them with the chat template, then generate.
        `tools` (OpenAI's function tools) reach the template as its `tools` variable."""
        from pagedllm.entrypoints.chat_utils import render_conversations

        if tools is not None and (chat_template_kwargs is None or isinstance(chat_template_kwargs, dict)):
            chat_template_kwargs = {"tools": tools, **(chat_template_kwargs or {})}
        mc = self.llm_engine.config.model_config
        placeholder = None
        if mc.is_multimodal:
            from pagedllm.multimodal.processing import image_placeholder

            placeholder = image_placeholder(mc.model_path, mc.trust_remote_code)
        prompts = render_conversations(
            self.get_tokenizer(), messages, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs, image_placeholder=placeholder,
        )
        if placeholder is not None:
            from pagedllm.entrypoints.media import connector_from_env

            connector = connector_from_env(mc.allowed_local_media_path, mc.allowed_media_domains)
            for prompt in prompts:
                if isinstance(prompt, dict) and "multi_modal_data" in prompt:
                    sources = prompt["multi_modal_data"]["image"]
                    prompt["multi_modal_data"]["image"] = [connector.load_image(src, f"image {j}")
                                                           for j, src in enumerate(sources)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: Sequence[PromptType], params: Any) -> list[Any]:
        """Beam search over the engine (see pagedllm/entrypoints/beam_search.py)."""
        from pagedllm.entrypoints.beam_search import run_beam_search

        return run_beam_search(self, prompts, params)


def _as_prompt_list(prompts) -> list:
    """One prompt (a string, a dict, or a list of token ids) or a sequence of them."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _per_prompt(params, prompts: list, what: str) -> list:
    params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} {what}")
    return params


def _key(prompt) -> str | tuple:
    """A hashable form of a prompt (a text, or token ids), to embed each distinct one once."""
    return prompt if isinstance(prompt, str) else ("ids", tuple(prompt))


def _unkey(key):
    return key if isinstance(key, str) else list(key[1])
