"""Where a decode step's time goes, with the decode plan (the step's C kernel calls bound once
and replayed, `worker/decode_plan.py`) and without it (the module path), in one process, the two
alternated; on the default model, or on another at its real shape with random weights:

    python benchmarks/profile_decode_plan.py [--batch 1] [--tokens 128] [--rounds 2]
    python benchmarks/make_shape_model.py llama-3.2-1b /tmp/llama-1b
    python benchmarks/profile_decode_plan.py --model /tmp/llama-1b --load-format dummy --quantization int4

`--batch` prompts of 32 random token ids decode together. Per step: wall time of
`LLM.generate` divided by the tokens per sequence, the time inside the C kernels (the module
path: timed around each `cpu_kernels` call, wrapper included; the plan: each bound call timed
alone in a replay of the last step, plus the head's kernels) and the rest (Python: scheduling,
input preparation, module dispatch, sampling, detokenizing).
"""

from __future__ import annotations

import argparse
import collections
import random
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.worker import decode_plan

KERNELS = ["w8a16_linear", "w4a16_linear", "u8s8_rank", "paged_decode_attention", "rms_norm", "topk_indices",
           "rescore_logits", "act_and_mul", "argmax_rows", "qk_norm_rope"]


def _timed_kernels(acc: collections.Counter) -> None:
    for name in KERNELS:
        fn = getattr(cpu_kernels, name)

        def timed(*a, _fn=fn, _name=name, **kw):
            start = time.perf_counter()
            out = _fn(*a, **kw)
            acc[_name] += time.perf_counter() - start
            return out

        setattr(cpu_kernels, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights (a shape-only model)")
    parser.add_argument("--quantization", default=None, help="the engine's --quantization (int8, int4)")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    acc: collections.Counter = collections.Counter()
    _timed_kernels(acc)
    plans: list[decode_plan.DecodePlan] = []
    real_run, real_takes = decode_plan.DecodePlan.run, decode_plan.DecodePlans.takes
    use_plan = [True]
    decode_plan.DecodePlan.run = lambda self, *a: plans.append(self) or real_run(self, *a)
    decode_plan.DecodePlans.takes = lambda self, *a: use_plan[0] and real_takes(self, *a)

    llm = LLM(args.model, load_format=args.load_format, quantization=args.quantization, dtype=args.dtype,
              max_model_len=1024)
    random.seed(0)
    prompt = [{"prompt_token_ids": [random.randint(100, 20000) for _ in range(32)]} for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)  # warm-up
    for _ in range(args.rounds):
        for plan_on in (False, True):
            use_plan[0] = plan_on
            acc.clear()
            plans.clear()
            start = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            step = (time.perf_counter() - start) / args.tokens * 1e3
            kernels = sum(acc.values()) / args.tokens * 1e3  # the head and sampler kernels, in both
            if plan_on and plans:
                plan = plans[-1]
                replay = 0.0
                with torch.inference_mode():  # the plan's buffers are inference tensors
                    for call in plan.calls:
                        t = time.perf_counter()
                        call()
                        replay += time.perf_counter() - t
                kernels += replay * 1e3 * len(plans) / args.tokens
            label = "plan  " if plan_on else "module"
            print(f"{label}: {step:6.2f} ms/step, kernels {kernels:6.2f} ms, the rest {step - kernels:6.2f} ms"
                  f" ({len(plans)} plan steps)")
            if not plan_on:
                print("        " + ", ".join(f"{name} {t / args.tokens * 1e3:.2f}" for name, t in acc.most_common()))


if __name__ == "__main__":
    main()
