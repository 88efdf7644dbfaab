"""Where a decode step's time goes: torch.profiler over engine steps of the default model.

    python benchmarks/profile_step.py --batch 64 [--quantization int8] [--steps 5]
    python benchmarks/profile_step.py --batch 1 --quantization int4 --steps 20
    python benchmarks/profile_step.py --model /work/models/gemma3-4b-q4_k_m.gguf --max-model-len 8192

Random token-id prompts of 32 tokens, greedy (or --temperature), ignore_eos (the W1 / W2 workloads); the first
10 steps (prefill and warm-up) are not profiled. Prints wall ms and minor page faults per
step, then the ops by self CPU time.
"""

from __future__ import annotations

import argparse
import random
import resource
import time

from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--quantization", default=None, choices=[None, "none", "int8", "int4"],
                        help="default: the model's default (int4 for the GGUF default model)")
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="1.0: random sampling over the full head, as `bench throughput` samples")
    parser.add_argument("--rows", type=int, default=25, help="ops to print")
    args = parser.parse_args()

    kwargs = {"model": args.model} if args.model else {}
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    engine = LLM(quantization=args.quantization, **kwargs).llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=args.temperature, max_tokens=10 + 2 * args.steps + 10, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), {"prompt_token_ids": [rng.randint(100, 20000) for _ in range(32)]}, params)
    for _ in range(10):
        engine.step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    print(f"wall: {(time.perf_counter() - start) / args.steps * 1e3:.1f} ms per step (batch {args.batch}); "
          f"{(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.steps:.0f} page faults per step")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
