"""Tiny random-weight checkpoints built from transformers configs, and reference runs."""

from __future__ import annotations

import os

import pytest
import torch

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in "
    "fixed-size blocks. Hello, my name is Ada and I like tea, cake and numbers 0123456789. "
    "Schedulers batch requests; caches share prefixes; tokens stream out one by one. "
    "Unicode: café, naïve, 日本語, emoji 🎉 ✓."
)


def build_tokenizer(path: str, vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on a small corpus, saved as HF files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(path)
    return fast


def tiny_config(arch: str, vocab_size: int, **overrides):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        cfg = LlamaConfig(**common, head_dim=16)
    elif arch == "mistral":
        cfg = MistralConfig(**common, head_dim=16, sliding_window=None)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common)
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=16)
    elif arch == "gemma3":
        common.update(tie_word_embeddings=True)
        cfg = Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=8,  # tiny, so prompts cross it
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        )
        cfg.architectures = ["Gemma3ForCausalLM"]
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_tiny_model(path: str, arch: str, seed: int = 0, added_tokens: tuple[str, ...] = (), **overrides) -> str:
    """Save a random-weight model + tokenizer to `path`; returns `path`. `added_tokens` (e.g.
    a reasoning model's "<think>", "</think>") become single tokens of the vocabulary."""
    os.makedirs(path, exist_ok=True)
    tok = build_tokenizer(path)
    if added_tokens:
        tok.add_tokens(list(added_tokens))
        tok.save_pretrained(path)
    return save_tiny_model(path, tiny_config(arch, len(tok), **overrides), seed)


def save_tiny_model(path: str, cfg, seed: int = 0) -> str:
    """Random weights for a transformers config, saved (safetensors) next to the tokenizer
    `build_tokenizer(path)` wrote there (its vocabulary must fit cfg.vocab_size)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init: less flat, fewer ties
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    return path


def hf_greedy(
    model_dir: str, prompts: list[list[int]], max_tokens: int, dtype: torch.dtype = torch.float32
) -> list[dict]:
    """transformers' greedy generate, one prompt at a time (no padding effects),
    with per-step logits so near-ties can be recognised."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    results = []
    for ids in prompts:
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
        tokens = out.sequences[0, len(ids):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
        results.append({"tokens": tokens, "logprobs": logprobs})
    return results


def assert_greedy_match(ours: list[list[int]], ref: list[dict], tol: float = 1e-3) -> None:
    """Equal token for token, or diverging only where the reference's top two are near-tied
    (after which the continuations legitimately differ)."""
    for i, (got, r) in enumerate(zip(ours, ref)):
        want = r["tokens"]
        for pos, (a, b) in enumerate(zip(got, want)):
            if a == b:
                continue
            lp = r["logprobs"][pos]
            top2 = lp.topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < tol and float(lp[b] - lp[a]) < tol, (
                f"prompt {i}: token {pos} differs ({a} vs {b}), top-2 gap {gap:.2e} is no tie\n"
                f"ours={got}\nref ={want}"
            )
            break
        else:
            assert len(got) == len(want), f"prompt {i}: length {len(got)} vs {len(want)}"


def cached_reference(name: str, key: dict, compute, topk: int = 32) -> list[dict]:
    """`compute()`'s reference runs ([{"tokens", "logprobs"}], as assert_greedy_match reads
    them), kept in the pagedllm cache under `key` (say what the reference depends on: files,
    library versions, prompts). Only each position's top-`topk` logprobs are kept; the rest read
    as -inf, which assert_greedy_match never needs: a tie is judged among the top tokens.
    PAGEDLLM_TEST_FRESH_REFERENCE=1 recomputes."""
    import hashlib
    import json

    from pagedllm.envs import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_root() / "test-references" / f"{name}-{digest}.pt"
    if path.exists() and os.environ.get("PAGEDLLM_TEST_FRESH_REFERENCE") != "1":
        stored = torch.load(path)
    else:
        stored = []
        for r in compute():
            top = torch.stack(r["logprobs"]).topk(topk, dim=-1)
            stored.append({"tokens": r["tokens"], "values": top.values, "indices": top.indices,
                           "vocab": r["logprobs"][0].numel()})
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(stored, tmp)
        os.replace(tmp, path)  # atomic: parallel test workers may share the cache
    refs = []
    for r in stored:
        dense = torch.full((len(r["tokens"]), r["vocab"]), float("-inf")).scatter_(1, r["indices"], r["values"])
        refs.append({"tokens": r["tokens"], "logprobs": list(dense)})
    return refs


def token_deltas(text: str, tok) -> list[str]:
    """`text` as a detokenizer streams it, token by token (half UTF-8 characters held back)."""
    ids, pieces, prev = tok.encode(text, add_special_tokens=False), [], ""
    for k in range(1, len(ids) + 1):
        cur = tok.decode(ids[:k])
        if cur.endswith("\ufffd"):
            continue
        assert cur.startswith(prev)
        pieces.append(cur[len(prev):])
        prev = cur
    assert prev == text
    return pieces


def chunkings(text: str, tok, seeds: int = 4, max_chunk: int = 8) -> dict[str, list[str]]:
    """Ways a stream may cut `text`: per character, per token, whole, and seeded random chunks."""
    import random

    out = {"chars": list(text), "tokens": token_deltas(text, tok), "whole": [text]}
    for seed in range(seeds):
        rng, pieces, i = random.Random(seed), [], 0
        while i < len(text):
            k = rng.randint(1, max_chunk)
            pieces.append(text[i:i + k])
            i += k
        out[f"random{seed}"] = pieces
    return out


# ---- offline generation on the tiny models ------------------------------------------------------------------

# Prompts whose greedy continuations on tiny_gemma3 the SamplingParams tests rely on.
PROMPT = "Paged attention stores keys and values in fixed-size blocks."
FOX = "The quick brown fox"  # greedy: one token repeated
CAFE = "Unicode: caf"  # greedy: ' He He He He' then 'ea' repeated


def generate_one(llm, prompt, **kwargs):
    """The RequestOutput of one prompt under SamplingParams(**kwargs)."""
    from pagedllm import SamplingParams

    return llm.generate(prompt, SamplingParams(**kwargs), use_tqdm=False)[0]


def greedy(llm, prompt, max_tokens: int = 10, **kwargs):
    """The one CompletionOutput of a greedy run of `max_tokens` tokens, EOS ignored."""
    return generate_one(llm, prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs).outputs[0]


def assert_idle(llm) -> None:
    """No request left in the engine and every KV block free."""
    stats = llm.llm_engine.get_stats()
    assert not llm.llm_engine.has_unfinished_requests()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@torch.inference_mode()
def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log_softmax of one transformers forward pass (row p predicts p + 1)."""
    return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)


@torch.inference_mode()
def ref_greedy(hf_model, prompt: list[int], n: int, transform) -> list[int]:
    """Greedy decoding with transformers, `transform(logits, prompt, output)` applied to
    each step's logits; asserts the argmax is never a near-tie (the case is well posed)."""
    import math

    out: list[int] = []
    for _ in range(n):
        logits = hf_model(torch.tensor([prompt + out])).logits[0, -1].double()
        logits = transform(logits.clone(), prompt, out)
        top2 = logits.topk(2).values
        assert top2[0] - top2[1] > 1e-3 or not math.isfinite(float(top2[1])), "near-tie: pick another case"
        out.append(int(logits.argmax()))
    return out


# ---- `pagedllm serve` processes -------------------------------------------------------------------------------

def worker_ranks(pid: int) -> list:
    """The worker processes of the executors under process `pid`: the children of its (or its
    engine core's) forkserver."""
    import psutil

    servers = [p for p in psutil.Process(pid).children(recursive=True) if "forkserver" in " ".join(p.cmdline())]
    return [rank for server in servers for rank in server.children()]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, url: str, log, timeout: float = 120) -> None:
    """`pagedllm bench compare`'s poll of `url`/health, failing the test with the server's log
    (`log`, a Path) if the process exits first or `timeout` seconds pass."""
    from pagedllm.entrypoints.cli.bench_compare import wait_healthy as poll

    try:
        poll("server", proc, url, str(log), timeout)
        return
    except ValueError as e:
        message = str(e).split("\n", 1)[0]  # the full log follows, once
    pytest.fail(f"{message}\n{log.read_text()}")


# The real-model tests beyond the handful every run makes (each loads the default model; on
# 2 cores together they would push the suite past its time budget). PAGEDLLM_TEST_ALL_SLOW=1
# runs them too.
all_slow = pytest.mark.skipif(
    os.environ.get("PAGEDLLM_TEST_ALL_SLOW") != "1",
    reason="an extra real-model test: PAGEDLLM_TEST_ALL_SLOW=1 runs it",
)


# A chat template that shows image parts where they are (LLaVA's own templates do).
LLAVA_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def save_random_weights(model_cls, cfg, path: str, seed: int) -> None:
    """A transformers model of `cfg` with N(0, 0.1) matrices (seeded), saved under `path`."""
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
    model.save_pretrained(path)


def make_tiny_llava(path: str, seed: int = 0, image_size: int = 28, patch_size: int = 7) -> str:
    """A random-weight LLaVA-1.5 (CLIP tower, projector, Llama) with its processor (CLIP image
    processor, `<image>` token, a chat template), saved as transformers saves one."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    os.makedirs(path, exist_ok=True)
    tok = build_tokenizer(path)
    tok.add_tokens(["<image>"], special_tokens=True)
    tok.save_pretrained(path)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=image_size, patch_size=patch_size, projection_dim=32)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                      projector_hidden_act="gelu", vision_feature_layer=-2, vision_feature_select_strategy="default",
                      image_seq_length=(image_size // patch_size) ** 2)
    save_random_weights(LlavaForConditionalGeneration, cfg, path, seed)
    images = CLIPImageProcessor(size={"shortest_edge": image_size},
                                crop_size={"height": image_size, "width": image_size})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=patch_size, num_additional_image_tokens=1,
                   vision_feature_select_strategy="default", chat_template=LLAVA_CHAT_TEMPLATE).save_pretrained(path)
    return path


GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def make_tiny_gemma3_mm(path: str, seed: int = 0, image_size: int = 28, patch_size: int = 7,
                        tokens_per_image: int = 4) -> str:
    """A random-weight Gemma 3 with images (SigLIP tower, Gemma 3 projector and decoder) and its
    processor (<start_of_image> placeholder, `tokens_per_image` soft tokens per image), saved as
    transformers saves one. Its sliding window (8) is shorter than a prompt, longer than an image."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        PreTrainedTokenizerFast,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    os.makedirs(path, exist_ok=True)
    build_tokenizer(path)
    tok = PreTrainedTokenizerFast.from_pretrained(path, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    tok.save_pretrained(path)
    text = tiny_config("gemma3", len(tok))
    text.architectures = None
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=image_size, patch_size=patch_size)
    cfg = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=tokens_per_image,
                       boi_token_index=tok.boi_token_id, eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
                       image_token_index=tok.image_token_id)
    save_random_weights(Gemma3ForConditionalGeneration, cfg, path, seed)
    images = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=tokens_per_image,
                    chat_template=GEMMA3_CHAT_TEMPLATE).save_pretrained(path)
    return path


QWEN2_VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_qwen2_vl(path: str, version: str = "2", seed: int = 0) -> str:
    """A random-weight Qwen2-VL (`version` "2") or Qwen2.5-VL ("2.5") with its processor: 4-px
    patches merged 2x2, images resized to at most 32x32 px (a 24x16 image: 6 tokens, a larger one
    12), M-RoPE sections [2, 3, 3] over a 16-wide head. Saved as transformers saves one."""
    import json

    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    os.makedirs(path, exist_ok=True)
    build_tokenizer(path)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.add_tokens(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"], special_tokens=True)
    tok.save_pretrained(path)
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in (("image_token_id", "<|image_pad|>"),
                                                         ("video_token_id", "<|video_pad|>"),
                                                         ("vision_start_token_id", "<|vision_start|>"),
                                                         ("vision_end_token_id", "<|vision_end|>"))}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    if version == "2":
        from transformers import Qwen2VLConfig as Config
        from transformers import Qwen2VLForConditionalGeneration as Model

        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2)
    else:
        from transformers import Qwen2_5_VLConfig as Config
        from transformers import Qwen2_5_VLForConditionalGeneration as Model

        vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=4, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1])
    cfg = Config(text_config=text, vision_config=vision, **ids)
    save_random_weights(Model, cfg, path, seed)
    images = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                      size={"shortest_edge": 64, "longest_edge": 32 * 32})
    # The processor's files as Qwen2VLProcessor.save_pretrained writes them, but for its video half
    # (Qwen2VLVideoProcessor needs torchvision, which is not installed).
    images.save_pretrained(path)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "Qwen2VLProcessor"}, f)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(QWEN2_VL_CHAT_TEMPLATE)
    return path


def random_image(seed: int, width: int = 50, height: int = 40):
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8))


def data_url(image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def hf_llava_greedy(model_dir: str, text: str, images: list, max_tokens: int) -> list[int]:
    """transformers' greedy generate on a vision-language checkpoint (LLaVA, Gemma 3), through
    its own processor."""
    return hf_vlm_greedy(model_dir, text, images, max_tokens)[0]


def hf_vlm_greedy(model_dir: str, text: str, images: list, max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens on a vision-language checkpoint, through its own processor,
    and each token's logprob."""
    from transformers import AutoModelForImageTextToText

    from pagedllm.multimodal.processing import load_hf_processor

    processor = load_hf_processor(model_dir)  # transformers' own, without a video half needing torchvision
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.logits, tokens)]
    return tokens, logprobs
