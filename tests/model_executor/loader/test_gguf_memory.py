"""A GGUF runs in the memory its file takes: a ~250 MB Q8_0 llama file is loaded and served
in a fresh process whose peak RSS stays within 1.2 x the file + the KV cache + 1 GiB (the
float32 model alone would be ~930 MB more), and its cache directory holds no weights."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from tests.model_executor.loader.hf_to_gguf import _metadata, _tokenizer, random_blocks  # noqa: E402
from tests.utils import build_tokenizer  # noqa: E402

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 1024, 4096, 16, 8, 2, 128
KV_CACHE = 64 << 20


def _write_llama_q8(path: Path, src: Path) -> None:
    """A llama-shaped GGUF whose matrices are random Q8_0 blocks, written one tensor at a time."""
    tok = build_tokenizer(str(src))
    cfg = {"model_type": "llama", "vocab_size": len(tok), "hidden_size": HIDDEN, "intermediate_size": FFN,
           "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
           "head_dim": HEAD_DIM, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    (src / "config.json").write_text(json.dumps(cfg))
    vocab = cfg["vocab_size"]
    tensors = [("token_embd.weight", (vocab, HIDDEN)), ("output_norm.weight", (HIDDEN,)),
               ("output.weight", (vocab, HIDDEN))]
    for b in range(LAYERS):
        tensors += [(f"blk.{b}.attn_norm.weight", (HIDDEN,)), (f"blk.{b}.ffn_norm.weight", (HIDDEN,)),
                    (f"blk.{b}.attn_q.weight", (HEADS * HEAD_DIM, HIDDEN)),
                    (f"blk.{b}.attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
                    (f"blk.{b}.attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
                    (f"blk.{b}.attn_output.weight", (HIDDEN, HEADS * HEAD_DIM)),
                    (f"blk.{b}.ffn_gate.weight", (FFN, HIDDEN)), (f"blk.{b}.ffn_up.weight", (FFN, HIDDEN)),
                    (f"blk.{b}.ffn_down.weight", (HIDDEN, FFN))]
    q8 = gguf.GGMLQuantizationType.Q8_0
    block, size = gguf.GGML_QUANT_SIZES[q8]
    w = gguf.GGUFWriter(str(path), "llama")
    _metadata(w, "llama", cfg)
    _tokenizer(w, src, None)
    for name, dims in tensors:
        if len(dims) == 1:
            w.add_tensor_info(name, dims, np.dtype(np.float32), dims[0] * 4)
        else:
            w.add_tensor_info(name, (dims[0], dims[1] // block * size), np.dtype(np.uint8),
                              dims[0] * dims[1] // block * size, raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (_, dims) in enumerate(tensors):
        w.write_tensor_data(np.ones(dims, np.float32) if len(dims) == 1 else random_blocks(q8, *dims, seed=i))
    w.close()


_CHILD = textwrap.dedent("""
    import json, sys
    from pagedllm import LLM, SamplingParams
    llm = LLM(sys.argv[1], max_model_len=256, kv_cache_memory=int(sys.argv[2]))
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=4, temperature=0))
    quant = llm.llm_engine.config.model_config.quantization
    # VmHWM: this process image's own peak (ru_maxrss keeps the parent's peak across fork + exec)
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"peak": int(hwm.split()[1]) * 1024, "quantization": quant,
                      "tokens": len(out[0].outputs[0].token_ids)}))
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="the peak is read from /proc")
def test_gguf_peak_rss_within_file_plus_kv_plus_1gib(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "llama-q8.gguf"
    _write_llama_q8(path, tmp_path / "src")
    size = path.stat().st_size
    assert size > 200 << 20
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(KV_CACHE)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["quantization"] == "gguf" and result["tokens"] == 4
    bound = 1.2 * size + KV_CACHE + (1 << 30)
    assert result["peak"] <= bound, f"peak RSS {result['peak'] / 2**20:.0f} MiB > {bound / 2**20:.0f} MiB"
    (converted,) = (tmp_path / "cache" / "gguf").iterdir()
    assert sum(p.stat().st_size for p in converted.iterdir()) < 1 << 20  # config and tokenizer only
