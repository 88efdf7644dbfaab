"""`pagedllm bench throughput --dataset random-mm`: image prompts for a vision-language model
(vLLM's random-mm dataset): random words, then one placeholder per image, random-pixel images;
`--mm-unique-images` repeats a few images to measure the processed-image and encoder caches. The
transformers backend runs the same prompts through the checkpoint's processor and `generate`."""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from pagedllm.config import EngineConfig

RANDOM_MM = "random-mm"


def add_mm_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mm-images-per-prompt", type=int, default=1, help="images per random-mm prompt")
    parser.add_argument("--mm-image-size", type=int, default=336, help="random-mm images' width and height")
    parser.add_argument("--mm-unique-images", type=int, default=0,
                        help="distinct random-mm images, cycled over the prompts (0: every image distinct)")


def random_mm_prompts(config: EngineConfig, tokenizer: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    import numpy as np
    from PIL import Image

    from pagedllm.multimodal.processing import image_placeholder

    mc = config.model_config
    if not mc.is_multimodal:
        raise ValueError(f"--dataset {RANDOM_MM} needs a vision-language model; {mc.architecture} takes no images")
    placeholder = image_placeholder(mc.model_path, mc.trust_remote_code)
    rng = random.Random(0)
    vocab = min(mc.text_config.vocab_size, len(tokenizer))
    banned = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    words = [t for t in range(min(vocab, 20000)) if t not in banned]
    per_prompt, size = args.mm_images_per_prompt, args.mm_image_size
    total = args.num_prompts * per_prompt
    distinct = args.mm_unique_images or total
    pixels = np.random.RandomState(0)
    images = [Image.fromarray((pixels.rand(size, size, 3) * 255).astype(np.uint8)) for _ in range(min(distinct, total))]
    prompts = []
    for i in range(args.num_prompts):
        text = tokenizer.decode([rng.choice(words) for _ in range(args.input_len)])
        chosen = [images[(i * per_prompt + j) % len(images)] for j in range(per_prompt)]
        prompts.append({"prompt": "\n".join([placeholder] * per_prompt + [text]),
                        "multi_modal_data": {"image": chosen}})
    return prompts


def run_hf_mm(args: argparse.Namespace, config: EngineConfig,
              prompts: list[dict[str, Any]]) -> tuple[float, float, int, int]:
    """transformers' generate on the same image prompts, `--hf-batch-size` at a time (left padding):
    (load s, generate s, output tokens, prompt tokens with the images' placeholders)."""
    from transformers import AutoModelForImageTextToText

    from pagedllm.multimodal.processing import load_hf_processor

    mc, device = config.model_config, config.device_config.device
    start = time.perf_counter()
    processor = load_hf_processor(mc.model_path, mc.trust_remote_code)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(mc.model_path, dtype=mc.dtype).to(device).eval()
    startup = time.perf_counter() - start
    pad_id = processor.tokenizer.pad_token_id if processor.tokenizer.pad_token_id is not None else 0
    bs = max(1, args.hf_batch_size)
    num_output = num_prompt = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), bs):
        batch = prompts[i:i + bs]
        inputs = processor(text=[p["prompt"] for p in batch], images=[im for p in batch
                                                                         for im in p["multi_modal_data"]["image"]],
                           padding=True, return_tensors="pt").to(device)
        out = model.generate(**inputs, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                             do_sample=False, pad_token_id=pad_id)
        num_output += (out.shape[1] - inputs["input_ids"].shape[1]) * out.shape[0]
        num_prompt += int(inputs["attention_mask"].sum())
    return startup, time.perf_counter() - start, num_output, num_prompt
