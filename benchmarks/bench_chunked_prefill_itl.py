"""Decode inter-token latency of running requests while a long prompt is prefilled in chunks.

Four requests decode (32-token prompts, greedy, ignore_eos); their step time alone (the median
of 30 steps before and 30 after) is the unloaded ITL. Then a 4,096-token prompt arrives and is
prefilled in chunks of at most `--max-num-batched-tokens` tokens per step, sharing each step
with the four decodes: their ITL over those steps (median, 90th percentile and max) against
the unloaded one, and how long the prefill took. `--long-prefill-token-threshold` caps the long
prompt's chunks instead, under the default budget.

    python benchmarks/bench_chunked_prefill_itl.py --max-num-batched-tokens 256 1024 8192
    python benchmarks/bench_chunked_prefill_itl.py --max-num-batched-tokens 8192 --long-prefill-token-threshold 16 32
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedllm import LLM, SamplingParams


def one_setting(budget: int, threshold: int, long_len: int, decodes: int) -> dict[str, float]:
    engine = LLM(max_num_batched_tokens=budget, long_prefill_token_threshold=threshold,
                 max_model_len=long_len + 64).llm_engine
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

    unloaded = [timed_step()[0] for _ in range(30)]
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
    unloaded += [timed_step()[0] for _ in range(30)]  # before and after: this machine's speed drifts
    for i in range(decodes):
        engine.abort_request(f"d{i}")
    return {"unloaded ms": statistics.median(unloaded) * 1e3, "median ms": statistics.median(loaded) * 1e3,
            "p90 ms": statistics.quantiles(loaded, n=10)[-1] * 1e3 if len(loaded) > 1 else loaded[0] * 1e3,
            "max ms": max(loaded) * 1e3, "prefill s": prefill_s, "steps": len(loaded)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[256, 1024, 8192])
    parser.add_argument("--long-prefill-token-threshold", type=int, nargs="+", default=[0])
    parser.add_argument("--long-len", type=int, default=4096)
    parser.add_argument("--decodes", type=int, default=4)
    args = parser.parse_args()
    print(f"| max_num_batched_tokens | long_prefill_token_threshold | unloaded ITL ms "
          f"| ITL during prefill, median / p90 / max ms | p90 / max over unloaded "
          f"| {args.long_len}-token prefill s (steps) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for budget in args.max_num_batched_tokens:
        for threshold in args.long_prefill_token_threshold:
            r = one_setting(budget, threshold, args.long_len, args.decodes)
            base = r["unloaded ms"]
            print(f"| {budget} | {threshold} | {base:.1f} | {r['median ms']:.1f} / {r['p90 ms']:.1f} / "
                  f"{r['max ms']:.1f} | {r['p90 ms'] / base:.1f}x / {r['max ms'] / base:.1f}x | "
                  f"{r['prefill s']:.1f} ({r['steps']}) |", flush=True)


if __name__ == "__main__":
    main()
