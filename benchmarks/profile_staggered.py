"""Step times under staggered arrivals, the way a server sees them: `--batch` requests run, and
whenever one finishes a new one arrives, so most steps are decodes and some also carry a new
prompt. Offsets the requests' output lengths so that their ends (and the arrivals) spread over
the steps, then prints the wall time of decode-only steps and of steps that carry a prompt,
next to what a pure decode step and a prompt alone cost.

    python benchmarks/profile_staggered.py [--model M] [--batch 16] [--input-len 128] \\
        [--output-len 128] [--requests 64] [--profile]

`--profile` adds torch.profiler's op table over the steady state.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedllm import LLM, SamplingParams


def _prompt(rng: random.Random, n: int) -> dict:
    return {"prompt_token_ids": [rng.randint(100, 20000) for _ in range(n)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    kwargs = {"quantization": args.quantization} if args.quantization else {}
    engine = LLM(args.model, **kwargs).llm_engine if args.model else LLM(**kwargs).llm_engine
    rng = random.Random(0)
    sent = 0

    def send(out_len: int) -> None:
        nonlocal sent
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        engine.add_request(str(sent), _prompt(rng, args.input_len), params)
        sent += 1

    # Staggered ends: request i of the first wave stops after its share of the output length.
    for i in range(args.batch):
        send(max(1, args.output_len * (i + 1) // args.batch))
    decode_ms, mixed_ms = [], []
    prof = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        prof = profile(activities=[ProfilerActivity.CPU])
        prof.start()
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        ms = (time.perf_counter() - start) * 1e3
        finished = sum(o.finished for o in outputs)
        new_tokens = [o for o in outputs if len(o.outputs[0].token_ids) == 1]
        if sent > args.batch:
            (mixed_ms if new_tokens else decode_ms).append(ms)
        for _ in range(finished):
            if sent < args.requests:
                send(args.output_len)
    if prof is not None:
        prof.stop()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(f"decode-only steps: {len(decode_ms)}, median {statistics.median(decode_ms):.1f} ms")
    if mixed_ms:
        print(f"steps with a prompt: {len(mixed_ms)}, median {statistics.median(mixed_ms):.1f} ms, "
              f"mean {statistics.mean(mixed_ms):.1f} ms")
    total = sum(decode_ms) + sum(mixed_ms)
    print(f"steady state: {len(decode_ms) + len(mixed_ms)} steps in {total / 1e3:.1f} s")
    # A prompt alone and a full decode step, for scale.
    send(1)
    start = time.perf_counter()
    engine.step()
    print(f"one prompt of {args.input_len} alone: {(time.perf_counter() - start) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
