"""Where a decode step's time goes on CUDA: the captured forward pass (graph replay) and the
same pass run eagerly, per batch bucket, against the weight-read limit (decoder + LM head bytes /
the device's copy bandwidth); the LM head alone; the rest of the step is the engine's host work.
`python benchmarks/profile_cuda_step.py MODEL_DIR --load-format dummy [--output-json F]`."""

from __future__ import annotations

import argparse
import json

import torch
from attention_bandwidth import _time_ms, copy_bandwidth  # the script's own folder


def main() -> None:
    from pagedllm import LLM

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--sizes", default="1,8,32,128,256")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    llm = LLM(args.model, load_format=args.load_format, dtype="bfloat16", max_model_len=2048,
              max_num_seqs=max(sizes))
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    model, graphs = runner.model, runner.cuda_graphs
    embed = model.model.embed_tokens.weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    if getattr(model, "lm_head", None) is not None and model.lm_head.weight is embed:  # tied: the head reads it
        weight_bytes += embed.numel() * embed.element_size()
    peak = copy_bandwidth(torch.device("cuda"))
    limit_ms = weight_bytes / peak * 1e3
    print(f"{torch.cuda.get_device_name()}: copy {peak / 1e12:.2f} TB/s; weights read per step "
          f"{weight_bytes / 1e9:.2f} GB -> limit {limit_ms:.2f} ms")
    rows = []
    with torch.inference_mode():
        for size in sizes:
            graph, out = graphs.graphs[size]
            graph_ms = _time_ms(graph.replay)
            eager_ms = _time_ms(lambda s=size: graphs._forward(s))
            hidden = out[:size].clone()
            head_ms = _time_ms(lambda h=hidden: model.compute_logits(h).argmax(-1))
            rows.append({"batch": size, "graph_forward_ms": graph_ms, "eager_forward_ms": eager_ms,
                         "lm_head_argmax_ms": head_ms})
            print(f"batch {size:4d}: forward {graph_ms:.2f} ms in a graph, {eager_ms:.2f} ms eager; "
                  f"LM head + argmax {head_ms:.2f} ms; forward + head = {(graph_ms + head_ms) / limit_ms:.2f}x limit")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "weight_bytes": weight_bytes, "copy_bytes_per_s": peak,
                       "limit_ms": limit_ms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
