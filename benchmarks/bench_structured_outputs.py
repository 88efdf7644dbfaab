"""Do small JSON schemas finish? On the default model (a 270M base model), each schema is sampled
with several seeds through the chat template, and the share of outputs that end with
finish_reason "stop" and parse as valid JSON for the schema is printed per schema.

    python benchmarks/bench_structured_outputs.py                   # 10 seeds, temperature 0.7, 100 tokens
    python benchmarks/bench_structured_outputs.py --seeds 20 --unbounded   # xgrammar's unbounded JSON grammar
    python benchmarks/bench_structured_outputs.py --show            # print every output

All requests go to the engine in one generate() call, so they run batched.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import jsonschema

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
ENUM = {"type": "object", "properties": {"sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]}},
        "required": ["sentiment"]}
NESTED = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "details": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "year": {"type": "integer"},
    }, "required": ["tags", "year"]},
}, "required": ["title", "details"]}
OBJECT = {"type": "object"}  # what json_object promises; checked with jsonschema like the others

# name -> (user message, schema or None for json_object)
CASES: dict[str, tuple[str, dict | None]] = {
    "person": ("Describe a person as JSON with their name and age.", PERSON),
    "enum": ("Is the review 'The food was great!' positive, negative or neutral? Answer in JSON.", ENUM),
    "nested": ("Describe a book as JSON: its title, and details with up to three tags and the year.", NESTED),
    "json_object": ("Describe a cat as a JSON object.", None),
}


@dataclass
class Result:
    name: str
    finished: int  # ended with "stop" and valid for the schema
    total: int
    outputs: list[tuple[str, str]]  # (finish_reason, text)
    tokens: int = 0

    @property
    def rate(self) -> float:
        return self.finished / self.total


def structured(schema: dict | None, unbounded: bool = False) -> StructuredOutputsParams:
    if schema is None:
        return StructuredOutputsParams(json_object=True, unbounded=unbounded)
    return StructuredOutputsParams(json=schema, unbounded=unbounded)


def valid(text: str, schema: dict | None) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema or OBJECT)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run(llm: LLM, seeds: int = 10, temperature: float = 0.7, max_tokens: int = 100,
        unbounded: bool = False) -> list[Result]:
    """Every case × seed as one request, all in a single chat() call."""
    convs, params, names = [], [], []
    for name, (message, schema) in CASES.items():
        for seed in range(seeds):
            convs.append([{"role": "user", "content": message}])
            params.append(SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                                         structured_outputs=structured(schema, unbounded)))
            names.append(name)
    outs = llm.chat(convs, params, use_tqdm=False)
    results = {name: Result(name, 0, 0, []) for name in CASES}
    for name, out in zip(names, outs):
        c = out.outputs[0]
        r = results[name]
        r.total += 1
        r.tokens += len(c.token_ids)
        r.outputs.append((c.finish_reason, c.text))
        if c.finish_reason == "stop" and valid(c.text, CASES[name][1]):
            r.finished += 1
    return list(results.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--unbounded", action="store_true", help="xgrammar's JSON grammar without pagedllm's bounds")
    ap.add_argument("--show", action="store_true", help="print every output")
    args = ap.parse_args()
    kwargs = dict(max_model_len=1024, kv_cache_memory=256 << 20)
    llm = LLM(args.model, **kwargs) if args.model else LLM(**kwargs)
    start = time.perf_counter()
    results = run(llm, args.seeds, args.temperature, args.max_tokens, args.unbounded)
    elapsed = time.perf_counter() - start
    tokens = sum(r.tokens for r in results)
    print(f"{'schema':<12} {'stop+valid':>10}  rate")
    for r in results:
        print(f"{r.name:<12} {r.finished:>4} / {r.total:<3}  {r.rate:.0%}")
        if args.show:
            for reason, text in r.outputs:
                print(f"    [{reason}] {text!r}")
    print(f"{len(results) * args.seeds} requests, {tokens} output tokens in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
