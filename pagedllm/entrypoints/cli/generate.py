"""`pagedllm generate`: run prompts through the offline engine and print the text."""

from __future__ import annotations

import argparse
import sys
import time

from pagedllm.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(p, model_positional=True)
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt (repeatable); without it, lines are read from stdin")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("error: no prompt given (use --prompt or stdin)", file=sys.stderr)
        return 2
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.sampling_seed, ignore_eos=args.ignore_eos,
    )
    start = time.perf_counter()
    engine_args = engine_args_from_namespace(args)
    llm = LLM(**vars(engine_args))
    loaded = time.perf_counter()
    outputs = llm.generate(prompts, params)
    done = time.perf_counter()
    for out in outputs:
        print(f"--- prompt: {out.prompt!r}")
        print(out.prompt + out.outputs[0].text if out.prompt else out.outputs[0].text)
        print(f"--- {len(out.outputs[0].token_ids)} tokens, finish_reason={out.outputs[0].finish_reason}")
    n = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"startup {loaded - start:.1f}s, generation {done - loaded:.2f}s "
          f"({n / max(done - loaded, 1e-9):.1f} output tok/s)", file=sys.stderr)
    return 0
