"""Decode inter-token latency of running requests while a long prompt is prefilled in chunks.

Four requests decode (32-token prompts, greedy, ignore_eos); their step time alone is the
unloaded ITL. Then a 4,096-token prompt arrives and is prefilled in chunks of at most
`--max-num-batched-tokens` tokens per step, sharing each step with the four decodes: their ITL
over those steps (median and max) against the unloaded one, and how long the prefill took.

    python benchmarks/bench_chunked_prefill_itl.py --max-num-batched-tokens 256 1024 8192
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedllm import LLM, SamplingParams


def one_setting(budget: int, long_len: int, decodes: int) -> dict[str, float]:
    engine = LLM(max_num_batched_tokens=budget, max_model_len=long_len + 64).llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=100000, ignore_eos=True)
    for i in range(decodes):
        engine.add_request(f"d{i}", {"prompt_token_ids": [rng.randint(100, 20000) for _ in range(32)]}, params)
    for _ in range(5):  # prefill and warm-up
        engine.step()

    def timed_step() -> tuple[float, list]:
        t = time.perf_counter()
        outs = engine.step()
        return time.perf_counter() - t, outs

    unloaded = statistics.median(timed_step()[0] for _ in range(10))
    prompt = [rng.randint(100, 20000) for _ in range(long_len)]
    engine.add_request("long", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))
    loaded: list[float] = []
    start = time.perf_counter()
    while True:
        dt, outs = timed_step()
        loaded.append(dt)
        if any(o.request_id == "long" and o.finished for o in outs):
            break
    prefill_s = time.perf_counter() - start
    for i in range(decodes):
        engine.abort_request(f"d{i}")
    return {"unloaded ms": unloaded * 1e3, "median ms": statistics.median(loaded) * 1e3,
            "max ms": max(loaded) * 1e3, "prefill s": prefill_s, "steps": len(loaded)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[256, 1024, 8192])
    parser.add_argument("--long-len", type=int, default=4096)
    parser.add_argument("--decodes", type=int, default=4)
    args = parser.parse_args()
    print(f"| max_num_batched_tokens | unloaded ITL ms | ITL during prefill, median / max ms | max / unloaded "
          f"| {args.long_len}-token prefill s (steps) |")
    print("| --- | --- | --- | --- | --- |")
    for budget in args.max_num_batched_tokens:
        r = one_setting(budget, args.long_len, args.decodes)
        print(f"| {budget} | {r['unloaded ms']:.1f} | {r['median ms']:.1f} / {r['max ms']:.1f} | "
              f"{r['max ms'] / r['unloaded ms']:.1f}x | {r['prefill s']:.1f} ({r['steps']}) |", flush=True)


if __name__ == "__main__":
    main()
