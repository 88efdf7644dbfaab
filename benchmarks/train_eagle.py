"""Train an EAGLE-3 head for a target model on the target's own greedy answers, on the CPU, and
write it in the Hub layout (`yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`'s), so the engine loads it as
any downloaded head:

    python benchmarks/train_eagle.py --out /work/models/eagle3-gemma3-270m    # the default model
    pagedllm serve --speculative-config '{"method": "eagle3", "model": "/work/models/eagle3-gemma3-270m",
        "num_speculative_tokens": 3}'

1. The target (pagedllm itself, with its quantized weights) answers chat prompts greedily
   (`eagle_prompts.train_prompts`, and with `--word-prompts` `word_prompts`), so each answer
   token is the target's argmax. `--answers FILE` keeps them for the next run. The head's top-1
   on the target's answers to `eagle_prompts.DEV` is reported at the end, for choosing a recipe
   without looking at `HELD_OUT`.
2. One teacher-forced pass of the target over each prompt + answer keeps the residual stream
   entering three of its layers (the head's input, `DecoderStack.aux_hidden_layers`) and the
   tokens' embeddings, exactly as the engine computes them when it drafts.
3. The draft vocabulary is the answers' tokens, then (to its size) the tokens of Python's help
   topics and the tokenizer's lowest ids, its commonest merges (`d2t` maps it to the target's).
4. The head (fc over the three layers' states, one decoder layer over [embedding; hidden], a
   norm and an LM head over the draft vocabulary) learns to predict each answer token, with
   EAGLE-3's training-time test: step j feeds its own outputs of step j - 1 back, attending to
   step 0's keys causally and to its own earlier steps' keys at the same row, as the engine's
   chained drafts do. With `--induction-init` (the default) its last KV head starts as a copying
   head (`eagle_induction.py`): the target's answers repeat the user's words.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch
from eagle_induction import copy_attention_hits, induction_init
from eagle_prompts import DEV, OPENERS, SELF_WRITTEN_PREFIX, topic_tokens_text, train_prompts, word_prompts
from torch import nn
from torch.nn import functional as F


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt's token ids as the engine's chat (LLM.chat, /v1/chat/completions) renders them."""
    from pagedllm.entrypoints.chat_utils import render_conversations

    rendered = render_conversations(tokenizer, [{"role": "user", "content": prompt}])[0]
    return rendered["prompt_token_ids"] if isinstance(rendered, dict) else tokenizer(rendered).input_ids


def generate(llm, prompts: list[str], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    from pagedllm import SamplingParams

    tokenizer = llm.get_tokenizer()
    ids = [chat_ids(tokenizer, p) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0, max_tokens=max_tokens))
    return [(i, list(o.outputs[0].token_ids)) for i, o in zip(ids, outs)]


def self_written_prompts(llm, num: int, seed: int) -> list[str]:
    """`num` distinct user requests the target writes itself: a list of requests to an assistant,
    each item begun with one of `OPENERS` and continued by the target, sampled (temperature 1,
    top-p 0.95) to the end of its line. Subjects and forms are then the target's, not a template's."""
    from pagedllm import SamplingParams

    rng, out, seen, tries = random.Random(seed), [], set(), 0
    while len(out) < num and tries < 4:
        openers = [rng.choice(OPENERS) for _ in range(2 * (num - len(out)))]
        params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=40, stop=["\n"], seed=rng.randrange(2**31))
                  for _ in openers]
        outs = llm.generate([SELF_WRITTEN_PREFIX + o for o in openers], params, use_tqdm=False)
        for opener, o in zip(openers, outs):
            text = (opener + o.outputs[0].text).strip()
            if o.outputs[0].finish_reason == "stop" and len(text.split()) >= 4 and text not in seen:
                seen.add(text)
                out.append(text)
        tries += 1
    return out[:num]


@torch.inference_mode()
def target_features(llm, seqs: list[list[int]], aux: tuple[int, ...], max_tokens: int = 4096):
    """(the residual stream entering the `aux` layers, side by side; the tokens' embeddings) of
    each sequence, from teacher-forced passes of the engine's own model."""
    from pagedllm.forward_context import set_forward_context
    from pagedllm.worker.step_inputs import prepare_inputs

    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    trunk = getattr(runner.model, runner.model.trunk_name)
    trunk.aux_hidden_layers = aux
    embed = getattr(trunk, trunk.embed_name)
    bs = runner.block_size
    feats, embeds = [], []
    i = 0
    while i < len(seqs):
        batch, total = [], 0
        while i < len(seqs) and (not batch or total + len(seqs[i]) <= max_tokens):
            batch.append(seqs[i])
            total += len(seqs[i])
            i += 1
        tables, next_block = [], 1
        for s in batch:
            n = -(-len(s) // bs)
            tables.append(list(range(next_block, next_block + n)))
            next_block += n
        step = prepare_inputs(batch, [0] * len(batch), tables, bs, runner.device)
        with set_forward_context(step.attn_metadata):
            runner.model(step.input_ids, step.positions)
        states, rows = trunk.aux_hidden_states.float(), embed(step.input_ids).float()
        start = 0
        for s in batch:
            feats.append(states[start : start + len(s)])
            embeds.append(rows[start : start + len(s)])
            start += len(s)
    trunk.aux_hidden_layers = ()
    return feats, embeds


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    angles = positions[:, None].float() * theta ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = (torch.cat((f, f), -1)[:, None] for f in (angles.cos(), angles.sin()))
    return x * cos + torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1) * sin


class Head(nn.Module):
    """The EAGLE-3 head as the engine runs it (spec_decode/eagle3.py), in float32 for training."""

    def __init__(self, h: int, num_aux: int, heads: int, kv_heads: int, head_dim: int, inter: int, vocab: int,
                 eps: float, theta: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps, self.theta = heads, kv_heads, head_dim, eps, theta
        self.fc = nn.Linear(num_aux * h, h, bias=False)
        self.q_proj = nn.Linear(2 * h, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, h, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(h, inter, bias=False), nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.input_layernorm, self.hidden_norm = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
        self.post_attention_layernorm, self.norm = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, vocab, bias=False)

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        n = len(embeds)
        x = torch.cat((rms(embeds, self.input_layernorm, self.eps), rms(hidden, self.hidden_norm, self.eps)), -1)
        q = rope(self.q_proj(x).view(n, self.heads, self.head_dim), positions, self.theta)
        k = rope(self.k_proj(x).view(n, self.kv_heads, self.head_dim), positions, self.theta)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        rep = self.heads // self.kv_heads
        return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = hidden + self.o_proj(attn.reshape(len(hidden), -1))
        m = rms(x, self.post_attention_layernorm, self.eps)
        return x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))

    def unrolled(self, feats: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Pre-norm outputs of `steps` chained drafts over a sequence of L tokens. Step j's row p
        sits at position p + j, is fed token p + 1 + j and step j - 1's row p (step 0: the
        target's fused state at p), and attends to step 0's rows <= p and to row p of steps
        1..j. Step j has L - 1 - j rows."""
        length = len(embeds)
        hidden = self.fc(feats[: length - 1])
        k0 = v0 = None
        diag_k, diag_v, outs = [], [], []
        scale = self.head_dim**-0.5
        for j in range(steps):
            rows = length - 1 - j
            if rows < 1:
                break
            hidden = hidden[:rows]
            q, k, v = self.qkv(embeds[1 + j : 1 + j + rows], hidden, torch.arange(j, j + rows))
            if j == 0:
                k0, v0 = k, v
            else:
                diag_k.append(k)
                diag_v.append(v)
            scores = torch.einsum("phd,khd->hpk", q, k0[:rows]) * scale
            scores = scores.masked_fill(torch.ones(rows, rows, dtype=torch.bool).triu(1), float("-inf"))
            diag = [(q * dk[:rows]).sum(-1).T[..., None] * scale for dk in diag_k]  # [heads, rows, 1] each
            probs = torch.cat([scores, *diag], -1).softmax(-1)
            attn = torch.einsum("hpk,khd->phd", probs[..., :rows], v0[:rows])
            for s, dv in enumerate(diag_v):
                attn = attn + probs[..., rows + s].T[..., None] * dv[:rows]
            hidden = self.finish(hidden, attn)
            outs.append(hidden)
        return outs

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rms(out, self.norm, self.eps))


def draft_vocabulary(answers: list[list[int]], extra: list[int], size: int, vocab: int) -> torch.Tensor:
    """The answers' tokens, most frequent first, then those of `extra` (a text the answers do not
    cover), then the lowest ids (a tokenizer's commonest merges come first), up to `size`, in id
    order. Rows never seen as labels keep their embedding-row start."""
    counts = torch.bincount(torch.tensor([t for a in answers for t in a]), minlength=vocab)
    seen = counts.argsort(descending=True)
    seen = seen[counts[seen] > 0][:size]
    more = torch.bincount(torch.tensor(extra), minlength=vocab)
    more[seen] = 0
    fill = more.argsort(descending=True)[: size - len(seen)]
    top = torch.cat((seen, fill[more[fill] > 0]))
    taken = torch.zeros(vocab, dtype=torch.bool)
    taken[top] = True
    top = torch.cat((top, (~taken).nonzero().flatten()[: size - len(top)]))
    print(f"draft vocabulary: {len(top)} tokens ({len(seen)} from the answers)")
    return top.sort().values


def sequence_loss(head: Head, feats, embeds, tokens, prompt_len: int, to_draft: torch.Tensor, steps: int,
                  decay: float) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Cross-entropy of each step's drafts against the answer tokens (step j's row p guesses
    token p + 2 + j), and (right, counted) per step."""
    outs = head.unrolled(feats, embeds, steps)
    loss, stats = feats.new_zeros(()), []
    for j, out in enumerate(outs):
        labels = tokens[2 + j :]
        rows = len(labels)
        keep = (torch.arange(2 + j, 2 + j + rows) >= prompt_len) & (to_draft[labels] >= 0)
        if not keep.any():
            stats.append((0, 0))
            continue
        logits = head.logits(out[:rows][keep])
        target = to_draft[labels[keep]]
        loss = loss + decay**j * F.cross_entropy(logits, target)
        stats.append((int((logits.argmax(-1) == target).sum()), int(keep.sum())))
    return loss, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: pagedllm's default model)")
    ap.add_argument("--out", required=True, help="directory to write the head to")
    ap.add_argument("--num-prompts", type=int, default=1200)
    ap.add_argument("--max-tokens", type=int, default=160, help="answer length per prompt")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--intermediate-size", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rope-theta", type=float, default=1e6,
                    help="the head's rotary base (high, so that the copying head's match has slow dims)")
    ap.add_argument("--induction-init", action=argparse.BooleanOptionalAction, default=True,
                    help="start the head's last KV head as a copying head (eagle_induction.py)")
    ap.add_argument("--ttt-steps", type=int, default=3, help="chained steps trained (EAGLE-3's training-time test)")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--minutes", type=float, default=25.0, help="training time budget (after the data)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--self-written", type=float, default=0.0,
                    help="share of the prompts the target writes itself (self_written_prompts) instead of templates")
    ap.add_argument("--word-prompts", type=float, default=0.0,
                    help="share of the prompts whose subjects are common words of the tokenizer (word_prompts)")
    ap.add_argument("--answers", default=None,
                    help="JSON file of the prompts' token ids and answers: read where it exists, else written there")
    ap.add_argument("--aux-layers", type=int, nargs=3, default=None,
                    help="the target layers whose input the head reads (default: vLLM's 2, L/2, L-3)")
    args = ap.parse_args()
    if not (0.0 <= args.self_written <= 1.0 and 0.0 <= args.word_prompts <= 1.0 - args.self_written):
        ap.error("--self-written and --word-prompts are shares of the prompts, together in [0, 1]")

    from pagedllm import LLM

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    llm = LLM(args.model) if args.model else LLM()
    text = llm.llm_engine.config.model_config.text_config
    h, layers, vocab = text.hidden_size, text.num_hidden_layers, text.vocab_size
    aux = tuple(sorted(args.aux_layers)) if args.aux_layers else (2, layers // 2, layers - 3)
    if args.answers and os.path.exists(args.answers):
        with open(args.answers) as f:
            data = [tuple(pa) for pa in json.load(f)]
        print(f"read {len(data)} prompts and answers from {args.answers}")
    else:
        num_self = round(args.self_written * args.num_prompts)
        written = self_written_prompts(llm, num_self, args.seed) if num_self else []
        words = word_prompts(llm.get_tokenizer(), round(args.word_prompts * args.num_prompts), args.seed)
        prompts = written + words + train_prompts(args.num_prompts - len(written) - len(words), args.seed)
        print(f"{len(prompts)} prompts, {len(written)} written by the target, {len(words)} about common words "
              f"({time.perf_counter() - start:.0f} s)")
        data = generate(llm, prompts, args.max_tokens)
        if args.answers:
            with open(args.answers, "w") as f:
                json.dump(data, f)
    print(f"{sum(len(a) for _, a in data)} answer tokens for {len(data)} prompts "
          f"in {time.perf_counter() - start:.0f} s")
    dev = generate(llm, DEV, args.max_tokens)
    num_train = len(data)
    data = data + dev
    seqs = [p + a for p, a in data]
    feats, embeds = target_features(llm, seqs, aux)
    feats, embeds = [f.clone() for f in feats], [e.clone() for e in embeds]  # out of inference mode, for autograd
    print(f"target features in {time.perf_counter() - start:.0f} s")
    extra = llm.get_tokenizer()(topic_tokens_text(), add_special_tokens=False).input_ids
    draft_ids = draft_vocabulary([a for _, a in data[:num_train]], extra, args.draft_vocab, vocab)
    to_draft = torch.full((vocab,), -1, dtype=torch.int64)
    to_draft[draft_ids] = torch.arange(len(draft_ids))

    head = Head(h, len(aux), args.heads, args.kv_heads, args.head_dim, args.intermediate_size, len(draft_ids),
                1e-6, args.rope_theta)
    with torch.no_grad():  # start from the logit lens of the highest layer read: fc passes it on,
        head.fc.weight.mul_(0.1)  # the LM head is the target's (tied) embedding rows
        head.fc.weight[:, (len(aux) - 1) * h :] += torch.eye(h)
        runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
        trunk = getattr(runner.model, runner.model.trunk_name)
        head.lm_head.weight.copy_(getattr(trunk, trunk.embed_name)(draft_ids.to(runner.device)).float())
    del llm, runner, trunk
    if args.induction_init:
        fit = induction_init(head, feats[: min(300, num_train)], embeds[: min(300, num_train)],
                             head.lm_head.weight.detach())
        print(f"induction start: {', '.join(f'{k} {v:.3f}' for k, v in fit.items())}")

    order = list(range(num_train))
    random.Random(args.seed).shuffle(order)
    held = order[: max(8, len(order) // 20)]
    train = order[len(held) :]
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    total_steps = max(1, int(args.epochs * len(train) / args.batch))
    warmup = min(50, total_steps // 10)

    budget = args.minutes * 60

    def lr_at(step: int, elapsed: float) -> float:
        """Warmup, then a cosine to a tenth over whichever ends first, the epochs or the time
        budget, so that the last steps anneal however fast the host is."""
        if step < warmup:
            return (step + 1) / warmup
        progress = max((step - warmup) / max(1, total_steps - warmup), elapsed / budget)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    tokens = [torch.tensor(s) for s in seqs]
    prompt_lens = [len(p) for p, _ in data]

    def evaluate(rows: list[int]) -> list[float]:
        right = [[0, 0] for _ in range(args.ttt_steps)]
        with torch.no_grad():
            for i in rows:
                _, stats = sequence_loss(head, feats[i], embeds[i], tokens[i], prompt_lens[i], to_draft,
                                         args.ttt_steps, 0.8)
                for j, (r, c) in enumerate(stats):
                    right[j][0] += r
                    right[j][1] += c
        return [round(r / max(1, c), 4) for r, c in right]

    train_start = time.perf_counter()
    done = 0
    for step in range(total_steps):
        elapsed = time.perf_counter() - train_start
        if elapsed > budget:
            print(f"time budget reached at step {step} of {total_steps}")
            break
        done = step + 1
        for group in opt.param_groups:
            group["lr"] = args.lr * lr_at(step, elapsed)
        batch = [train[(step * args.batch + b) % len(train)] for b in range(args.batch)]
        opt.zero_grad()
        total = 0.0
        for i in batch:
            loss, _ = sequence_loss(head, feats[i], embeds[i], tokens[i], prompt_lens[i], to_draft, args.ttt_steps, 0.8)
            (loss / args.batch).backward()
            total += loss.item() / args.batch
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            print(f"step {step}/{total_steps} loss {total:.3f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{time.perf_counter() - train_start:.0f} s", flush=True)
        if step % 200 == 0 and step:
            print(f"held-out top-1 per step: {evaluate(held)}", flush=True)
    print(f"trained {done} steps in {time.perf_counter() - train_start:.0f} s; held-out top-1 per step: "
          f"{evaluate(held)}; on eagle_prompts.DEV: {evaluate(list(range(num_train, len(seqs))))}")
    with torch.no_grad():
        hits = copy_attention_hits(head, feats[num_train:], embeds[num_train:], tokens[num_train:],
                                   prompt_lens[num_train:])
    print(f"on DEV, the last attention head's top row holds the token just read in {hits:.3f} of the repeats")
    save(head, args, h, layers, vocab, aux, draft_ids, text)
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s in all")


def save(head: Head, args, h: int, layers: int, vocab: int, aux, draft_ids: torch.Tensor, text) -> None:
    from safetensors.torch import save_file

    os.makedirs(args.out, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": args.intermediate_size, "num_attention_heads": args.heads,
              "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "num_hidden_layers": 1,
              "vocab_size": vocab, "draft_vocab_size": len(draft_ids), "rms_norm_eps": head.eps,
              "rope_theta": head.theta, "max_position_embeddings": text.max_position_embeddings,
              "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
              # its LM head rows start as the target's embedding rows, so the context's other
              # tokens can be drafted on theirs (pagedllm/spec_decode/context_tokens.py)
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux), "draft_context_tokens": True},
              "target_layers": layers}
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    m = "midlayer."
    tensors = {"fc.weight": head.fc.weight, "norm.weight": head.norm, "lm_head.weight": head.lm_head.weight,
               m + "input_layernorm.weight": head.input_layernorm, m + "hidden_norm.weight": head.hidden_norm,
               m + "post_attention_layernorm.weight": head.post_attention_layernorm}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        tensors[f"{m}self_attn.{name}.weight"] = getattr(head, name).weight
    for name in ("gate_proj", "up_proj", "down_proj"):
        tensors[f"{m}mlp.{name}.weight"] = getattr(head, name).weight
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    tensors["d2t"] = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, os.path.join(args.out, "model.safetensors"))


if __name__ == "__main__":
    main()
