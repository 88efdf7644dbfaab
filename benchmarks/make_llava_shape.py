"""A random-weight LLaVA-1.5 in a mid-size shape, with its processor, for multimodal speed figures:
a ViT-B/16 CLIP tower (224 px, 196 image tokens), the LLaVA projector and a Qwen2-0.5B-shaped
Llama decoder (24 layers, hidden 896, 14 heads / 2 KV heads, MLP 4864, vocabulary 32000). The
tokenizer is a byte-level BPE trained on Python's own documentation text, plus `<image>`.

    python benchmarks/make_llava_shape.py /tmp/llava-mid
    pagedllm bench throughput --model /tmp/llava-mid --dataset random-mm --num-prompts 32 \\
        --input-len 32 --output-len 32 --mm-image-size 224 [--backend transformers]
"""

from __future__ import annotations

import argparse
import os

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def build_tokenizer(path: str, vocab_size: int = 8000):
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(topics.values()), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.add_tokens(["<image>"], special_tokens=True)
    fast.save_pretrained(path)
    return fast


def main() -> None:
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tok = build_tokenizer(args.out)
    text = LlamaConfig(vocab_size=32000, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                       rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              image_size=224, patch_size=16, projection_dim=512)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                      projector_hidden_act="gelu", vision_feature_layer=-2, vision_feature_select_strategy="default",
                      image_seq_length=196)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
    model.save_pretrained(args.out)
    images = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=16, num_additional_image_tokens=1,
                   vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE).save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {n / 1e6:.0f}M parameters")


if __name__ == "__main__":
    main()
