"""Speculative decoding on a repetitive workload: the same prompts, greedy, with and without
speculation, in one process (so the numbers share the machine's state).

    python benchmarks/bench_spec_decode.py                    # default model, n-gram
    python benchmarks/bench_spec_decode.py --draft-layers 15 --draft-keep-last 3  # + a truncated-copy draft

Prints output tok/s, acceptance rate, mean acceptance length, and checks that greedy outputs
are identical with and without speculation.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.truncated_draft import make_truncated_draft

PASSAGES = [
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
    "the members agreed to increase funding for the library, to repair the roof of the community hall, "
    "and to hire two new teachers for the primary school. The final vote was seven in favour and two against.",
    "To install the package, first create a virtual environment, then run pip install with the name of "
    "the package. If the installation fails, check that your version of Python is recent enough and that "
    "the network is reachable. Finally, run the tests to make sure everything works as expected.",
    "def area(width, height):\n    if width < 0 or height < 0:\n        raise ValueError('negative size')\n"
    "    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n",
    "The river flows from the mountains in the north to the sea in the south. Along its banks there are "
    "small villages, old mills and wide fields of wheat. In spring the water rises and the fields are "
    "flooded; in summer the river is slow and warm, and children swim near the bridges.",
]


def make_prompts(num: int) -> list[str]:
    prompts = []
    for i in range(num):
        text = PASSAGES[i % len(PASSAGES)]
        head = " ".join(text.split(" ")[:4])
        prompts.append(f"Copy the following text exactly.\n\nText:\n{text}\n\nCopy:\n{head}")
    return prompts


def run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[list[list[int]], float, dict]:
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    before = llm.get_metrics()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.get_metrics()
    ids = [o.outputs[0].token_ids for o in outs]
    tokens = sum(len(t) for t in ids)
    key = "pagedllm:spec_decode_num_{}"
    drafted = after.get(key.format("draft_tokens"), 0) - before.get(key.format("draft_tokens"), 0)
    accepted = after.get(key.format("accepted_tokens"), 0) - before.get(key.format("accepted_tokens"), 0)
    steps = after.get(key.format("drafts"), 0) - before.get(key.format("drafts"), 0)
    stats = {
        "output_tokens": tokens,
        "seconds": round(elapsed, 2),
        "tok_per_s": round(tokens / elapsed, 1),
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "mean_acceptance_length": round(1 + accepted / steps, 2) if steps else None,
    }
    return ids, elapsed, stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="max_num_seqs values to run")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=0, help="also run a truncated-copy draft model")
    ap.add_argument("--draft-keep-last", type=int, default=0, help="of those layers, the target's last ones")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    prompts = make_prompts(args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    specs = {"none": None, "ngram": {"method": "ngram", "num_speculative_tokens": args.k,
                                     "prompt_lookup_min": 2, "prompt_lookup_max": args.prompt_lookup_max}}
    if args.draft_layers:
        path = make_truncated_draft(args.model, tempfile.mkdtemp(prefix="draft-"), args.draft_layers,
                                    args.draft_keep_last)
        specs["draft"] = {"method": "draft_model", "model": path, "num_speculative_tokens": args.k}
    for batch in args.batch:
        reference = None
        for name, spec in specs.items():
            llm = LLM(args.model, dtype=args.dtype, max_num_seqs=batch, speculative_config=spec)
            ids, _, stats = run(llm, prompts, params)
            reference = reference or ids
            stats["identical_to_no_spec"] = ids == reference
            print(f"batch={batch} spec={name}: {stats}", flush=True)
            del llm


if __name__ == "__main__":
    main()
