"""The model runner's host time per decode step: what `ModelRunner.forward` and `sample_tokens`
spend outside the forward pass, the logits and the sampler's tensor work (building the step's
inputs and sampling metadata from the batch, and taking the sampled tokens back).

    python benchmarks/make_shape_model.py llama-tiny /tmp/llama-tiny
    python benchmarks/profile_runner_host.py --model /tmp/llama-tiny --batch 64 --prompt-len 512

A tiny model keeps the forward pass short, so the engine step's wall time is mostly host work
too. Half the requests are greedy, half sample (temperature 0.8, top-p 0.9, top-k 40, seeded);
every fourth has a presence penalty. Prints medians over the decode steps.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedllm import LLM, SamplingParams


class _Timer:
    """Wraps a bound method and adds its wall time to `total`."""

    def __init__(self, obj, name: str) -> None:
        self.total = 0.0
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start

        setattr(obj, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()

    llm = LLM(args.model, load_format=args.load_format, dtype="float32", max_num_seqs=args.batch,
              max_model_len=args.prompt_len + args.steps + 32, max_num_batched_tokens=args.batch * args.prompt_len)
    engine = llm.llm_engine
    runner = engine.engine_core.model_executor.driver_worker.model_runner
    timers = {name: _Timer(runner, name) for name in ("forward", "sample_tokens", "_run_model")}
    timers["logits"] = _Timer(runner.model, "compute_logits")
    timers["constraints"] = _Timer(runner.sampler, "apply_constraints")
    timers["sample"] = _Timer(runner.sampler, "sample")
    rng = random.Random(0)
    vocab = runner.model.config.vocab_size if hasattr(runner.model, "config") else 500
    for i in range(args.batch):
        if i % 2:
            params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=i, max_tokens=args.steps + 12,
                                    ignore_eos=True, presence_penalty=0.5 if i % 4 == 1 else 0.0)
        else:
            params = SamplingParams(temperature=0, max_tokens=args.steps + 12, ignore_eos=True)
        prompt = [rng.randrange(3, min(vocab, 30000)) for _ in range(args.prompt_len)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    started: set[str] = set()  # the prompts' prefill first
    while len(started) < args.batch:
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    for _ in range(5):
        engine.step()
    walls, hosts = [], []
    for _ in range(args.steps):
        before = {k: t.total for k, t in timers.items()}
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
        d = {k: t.total - before[k] for k, t in timers.items()}
        hosts.append(d["forward"] + d["sample_tokens"] - d["_run_model"] - d["logits"] - d["constraints"]
                     - d["sample"])
    print(f"batch {args.batch}, context {args.prompt_len}+: engine step {statistics.median(walls) * 1e3:.2f} ms, "
          f"runner host time {statistics.median(hosts) * 1e3:.3f} ms per decode step (median of {args.steps})")


if __name__ == "__main__":
    main()
