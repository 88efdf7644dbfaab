"""An EAGLE head against no speculation and n-gram speculation on held-out chat prompts
(`eagle_prompts.HELD_OUT`), greedy, every configuration in one process:

    python benchmarks/bench_eagle.py --head /work/models/eagle3-gemma3-270m --method eagle3 --k 1 2 3 4 5

`--head A B ...` runs every head's configurations in the same run (named after each head's
directory), so with `--paired` two heads are compared on the same prompts at the same time.

- batch 1: each prompt alone (`--paired`: by every configuration's engine in turn), TPOT =
  (time to 128 tokens - time to 1 token) / 127, summed over the prompts; mean acceptance length
  (1 + accepted drafts per verification, as vLLM counts it), and tokens per decode step (which
  also counts the steps that verified no drafts);
- batch B (`--batch-sizes B ...`; `--batch16` is 16): all prompts, B at a time (`max_num_seqs`),
  output tok/s: where speculation stops paying, for `disable_by_batch_size`;
- each configuration's greedy tokens must equal those without speculation (checked);
- how many of the answers' tokens the head's draft vocabulary holds (`d2t`): a draft outside it
  is never right, so this caps the acceptance at every position;
- `--llama-cpp-bin DIR` with `--paired`: llama.cpp's `llama-bench -t 2 -p 0 -n 128 -r 1` (tg128)
  on the same GGUF takes a turn in the rotation after each prompt, its ms/token the mean of its
  32 runs (llama.cpp is a peer, never a dependency: docs/performance.md says how it is built).
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import os
import subprocess
import time
from collections.abc import Callable

import torch
from eagle_prompts import HELD_OUT

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.eagle3 import EAGLE3_FILES
from pagedllm.spec_decode.head_files import load_head_tensors

KEYS = ("drafts", "draft_tokens", "accepted_tokens")


def counters(llm: LLM) -> dict[str, float]:
    """The speculation counters, and the accepted drafts at each position (`at:N`)."""
    m = llm.get_metrics()
    out = {k: m.get(f"pagedllm:spec_decode_num_{k}", 0.0) for k in KEYS}
    return out | {f"at:{k.rsplit(':', 1)[1]}": v for k, v in m.items() if "spec_decode_accepted_at:" in k}


def batch1(llm: LLM, prompts: list, max_tokens: int) -> tuple[float, list[list[int]], dict]:
    """Decode seconds per token at batch 1, the outputs, and the speculation counters' growth."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm up (and build the decode plans)
    before = counters(llm)
    decode, outs = 0.0, []
    for p in prompts:
        t0 = time.perf_counter()
        llm.generate([p], first, use_tqdm=False)
        t1 = time.perf_counter()
        outs.append(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
        t2 = time.perf_counter()
        decode += (t2 - t1) - (t1 - t0)
    after = counters(llm)
    return decode / (len(prompts) * (max_tokens - 1)), outs, {k: after[k] - before.get(k, 0.0) for k in after}


def llama_bench_tg128(bin_dir: str, gguf: str, threads: int = 2) -> Callable[[], float]:
    """One `llama-bench` tg128 run on `gguf`: seconds per token."""
    cmd = [os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-t", str(threads), "-p", "0", "-n", "128",
           "-r", "1", "-o", "csv"]

    def run() -> float:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        return 1.0 / float(next(csv.DictReader(io.StringIO(out)))["avg_ts"])
    return run


def paired_batch1(llms: list[LLM], prompts: list, max_tokens: int,
                  peer: Callable[[], float] | None = None) -> tuple[list[tuple[float, list[list[int]], dict]], float]:
    """`batch1` for several engines at once, each prompt taken by every engine in turn (the order
    rotated from prompt to prompt), so that a change in the host's speed falls on all alike; a
    `peer` (seconds per token of one run) takes its turn in the rotation too. Returns the engines'
    results and the peer's mean (0 without one)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for llm in llms:
        llm.generate(prompts[:1], params, use_tqdm=False)
    before = [counters(llm) for llm in llms]
    decode, outs, peer_runs = [0.0] * len(llms), [[] for _ in llms], []
    slots = len(llms) + (peer is not None)
    for n, p in enumerate(prompts):
        for i in [(n + j) % slots for j in range(slots)]:
            if i == len(llms):
                peer_runs.append(peer())
                continue
            t0 = time.perf_counter()
            llms[i].generate([p], first, use_tqdm=False)
            t1 = time.perf_counter()
            outs[i].append(llms[i].generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
            decode[i] += (time.perf_counter() - t1) - (t1 - t0)
    results = []
    for llm, d, o, b in zip(llms, decode, outs, before):
        after = counters(llm)
        results.append((d / (len(prompts) * (max_tokens - 1)), o, {k: after[k] - b.get(k, 0.0) for k in after}))
    return results, sum(peer_runs) / len(peer_runs) if peer_runs else 0.0


def target_gguf(model: str | None) -> str:
    """The GGUF file the target was loaded from (the default model's, when none is named)."""
    if model is None:
        from pagedllm.transformers_utils.default_model import resolve_default_model

        return resolve_default_model()
    if not model.endswith(".gguf"):
        raise SystemExit(f"--llama-cpp-bin runs llama-bench on a GGUF; --model {model!r} is not one")
    return model


def draft_vocab_coverage(head: str, answers: list[list[int]]) -> dict[str, float] | None:
    """The share of the answers' tokens (and of their distinct tokens) inside an EAGLE-3 head's
    draft vocabulary; None for a head that drafts over the whole vocabulary."""
    d2t = load_head_tensors(head, EAGLE3_FILES, "EAGLE head").get("d2t")
    if d2t is None:
        return None
    vocab = set((torch.arange(len(d2t)) + d2t.long()).tolist())
    tokens = [t for a in answers for t in a]
    distinct = set(tokens)
    return {"tokens": round(sum(t in vocab for t in tokens) / len(tokens), 4),
            "distinct": round(len(distinct & vocab) / len(distinct), 4), "num_distinct": len(distinct)}


def batched(llm: LLM, prompts: list, max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    ids = [o.outputs[0].token_ids for o in outs]
    return sum(len(i) for i in ids) / elapsed, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: pagedllm's default model)")
    ap.add_argument("--head", required=True, nargs="+", help="one head, or several to compare")
    ap.add_argument("--method", default="eagle3", choices=("eagle", "eagle3"))
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--ngram-k", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=len(HELD_OUT))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch16", action="store_true", help="also all prompts, 16 at a time (--batch-sizes 16)")
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[],
                    help="also all prompts, B at a time, for each B given")
    ap.add_argument("--disable-by-batch-size", type=int, default=None, help="speculative_config's, for every method")
    ap.add_argument("--draft-confidence-threshold", type=float, nargs="+", default=[0.0],
                    help="speculative_config's, each value with each --k (0: off)")
    ap.add_argument("--draft-context-tokens", choices=("head", "off", "on"), nargs="+", default=["head"],
                    help="speculative_config's draft_context_tokens (eagle3), each value with each --k and "
                         "threshold (head: as the head's config.json says)")
    ap.add_argument("--no-batch1", action="store_true", help="only the batched runs (--batch-sizes)")
    ap.add_argument("--paired", action="store_true",
                    help="batch 1 with every configuration's engine at once, each prompt run by all in turn "
                         "(a fair comparison on a host whose speed drifts)")
    ap.add_argument("--llama-cpp-bin", default=None,
                    help="with --paired: a directory holding llama.cpp's llama-bench, run on the same GGUF in turn")
    args = ap.parse_args()
    if args.llama_cpp_bin and not (args.paired and not args.no_batch1):
        ap.error("--llama-cpp-bin takes its turns in --paired's batch-1 rotation")
    sizes = sorted(set(args.batch_sizes + [16] * args.batch16))

    from train_eagle import chat_ids

    def engine(spec: dict | None, **kw) -> LLM:
        return LLM(args.model, speculative_config=spec, **kw) if args.model else LLM(speculative_config=spec, **kw)

    configs = [("none", None), ("ngram", {"method": "ngram", "num_speculative_tokens": args.ngram_k})]
    for head in args.head:
        label = f" {os.path.basename(os.path.normpath(head))}" if len(args.head) > 1 else ""
        for k in args.k:
            for t, ctx in itertools.product(args.draft_confidence_threshold, args.draft_context_tokens):
                spec = {"method": args.method, "model": head, "num_speculative_tokens": k}
                spec |= {"draft_confidence_threshold": t} if t else {}
                spec |= {"draft_context_tokens": ctx == "on"} if ctx != "head" else {}
                configs.append((f"{args.method} k={k}" + (f" c={t}" if t else "") +
                                (f" context {ctx}" if ctx != "head" else "") + label, spec))
    if args.disable_by_batch_size:
        for _, spec in configs[1:]:
            spec["disable_by_batch_size"] = args.disable_by_batch_size
    rows, reference, batch_reference, coverage = [], None, {}, {}
    paired, tokenizer = {}, None
    if args.paired and not args.no_batch1:  # every engine at once, with a smaller KV cache each
        llms = [engine(spec, kv_cache_memory=1 << 30, max_model_len=4096) for _, spec in configs]
        tokenizer = llms[0].get_tokenizer()
        prompts = [{"prompt_token_ids": chat_ids(tokenizer, p)} for p in HELD_OUT[: args.num_prompts]]
        peer = llama_bench_tg128(args.llama_cpp_bin, target_gguf(args.model)) if args.llama_cpp_bin else None
        results, peer_tpot = paired_batch1(llms, prompts, args.max_tokens, peer)
        paired = dict(zip((name for name, _ in configs), results))
        del llms
    for name, spec in configs:
        llm = engine(spec) if not paired else None
        if llm is not None:
            tokenizer = llm.get_tokenizer()
        prompts = [{"prompt_token_ids": chat_ids(tokenizer, p)} for p in HELD_OUT[: args.num_prompts]]
        row = {"config": name}
        if not args.no_batch1:
            tpot, outs, c = paired[name] if paired else batch1(llm, prompts, args.max_tokens)
            if reference is None:
                reference = outs
            if spec is not None and spec.get("model"):
                if spec["model"] not in coverage:
                    coverage[spec["model"]] = draft_vocab_coverage(spec["model"], [list(o) for o in reference])
                row["draft_vocab_coverage"] = coverage[spec["model"]]
            row |= {"batch1_tpot_ms": round(tpot * 1e3, 2), "same_tokens": outs == reference}
            if c["drafts"]:
                decoded = len(prompts) * (args.max_tokens - 1)  # after each prompt's first token
                row["tokens_per_step"] = round(decoded / (decoded - c["accepted_tokens"]), 3)
                row["mean_acceptance_length"] = round(1 + c["accepted_tokens"] / c["drafts"], 3)
                row["acceptance_rate"] = round(c["accepted_tokens"] / c["draft_tokens"], 3)
                positions = sorted((int(k[3:]), v) for k, v in c.items() if k.startswith("at:"))
                row["accepted_per_position"] = [round(v / c["drafts"], 3) for _, v in positions]
        for size in sizes:
            llm = None  # the previous engine's memory freed first
            llm = engine(spec, max_num_seqs=size)
            tps, ids = batched(llm, prompts, args.max_tokens)
            batch_reference.setdefault(size, ids)
            row[f"batch{size}_tok_s"] = round(tps, 1)
            row[f"batch{size}_same_tokens"] = ids == batch_reference[size]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del llm
    width = max(len(row["config"]) for row in rows)
    for row in rows:
        line = f"{row['config']:>{width}}:"
        if "batch1_tpot_ms" in row:
            speedup = rows[0]["batch1_tpot_ms"] / row["batch1_tpot_ms"]
            line += (f" batch-1 TPOT {row['batch1_tpot_ms']:6.2f} ms ({speedup:.2f}x)"
                     f"  acceptance length {row.get('mean_acceptance_length', '-')}")
        for size in sizes:
            speedup = row[f"batch{size}_tok_s"] / rows[0][f"batch{size}_tok_s"]
            line += f"  batch {size} {row[f'batch{size}_tok_s']} tok/s ({speedup:.2f}x)"
        if row.get("draft_vocab_coverage"):
            line += f"  answers' tokens in the head's draft vocabulary: {row['draft_vocab_coverage']}"
        print(line)
    if paired and args.llama_cpp_bin:
        print(json.dumps({"config": "llama.cpp llama-bench tg128", "batch1_tpot_ms": round(peer_tpot * 1e3, 2)}))
        print(f"llama.cpp llama-bench tg128: {peer_tpot * 1e3:6.2f} ms/token "
              f"({rows[0]['batch1_tpot_ms'] / (peer_tpot * 1e3):.2f}x of no speculation's speed)")


if __name__ == "__main__":
    main()
