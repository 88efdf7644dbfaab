"""benchmarks/eagle_induction.py: the copying start of a trained EAGLE-3 head. On sequences that
repeat themselves, its attention finds the earlier occurrence of the token just read, and its
first draft copies the token after it, before any training; a random start does neither."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")


@pytest.fixture(scope="module")
def bench(request):
    sys.path.insert(0, BENCHMARKS)
    request.addfinalizer(lambda: sys.path.remove(BENCHMARKS))
    # the scripts import each other by name, from benchmarks/ (not an installed package)
    return importlib.import_module("train_eagle"), importlib.import_module("eagle_induction")


def repeating_data(h: int, vocab: int, num: int, gen: torch.Generator):
    """Sequences of a random 12-token prompt then its three copies, with a target's fused states
    whose lowest layer carries the token read (plus noise) and whose other layers are smaller noise."""
    table = torch.randn(vocab, h, generator=gen)
    feats, embeds, tokens = [], [], []
    for _ in range(num):
        seq = torch.randperm(vocab, generator=gen)[:12].repeat(4)
        e = table[seq]
        low = 20 * e + torch.randn(len(seq), h, generator=gen)
        feats.append(torch.cat([low, torch.randn(len(seq), 2 * h, generator=gen) * 0.5], -1))
        embeds.append(e)
        tokens.append(seq)
    return table, feats, embeds, tokens


def make_head(train_eagle, h: int, table: torch.Tensor, seed: int):
    torch.manual_seed(seed)
    head = train_eagle.Head(h, 3, 4, 2, 32, 96, len(table), 1e-6, 1e6)
    with torch.no_grad():  # train_eagle's start: fc passes the highest layer, the LM head is the embedding
        head.fc.weight.mul_(0.1)
        head.fc.weight[:, 2 * h :] += torch.eye(h)
        head.lm_head.weight.copy_(table)
    return head


def first_draft_top1(train_eagle, head, feats, embeds, tokens, prompt_len: int) -> float:
    right = total = 0
    to_draft = torch.arange(len(head.lm_head.weight))
    with torch.no_grad():
        for f, e, t in zip(feats, embeds, tokens):
            _, stats = train_eagle.sequence_loss(head, f, e, t, prompt_len, to_draft, 1, 1.0)
            right, total = right + stats[0][0], total + stats[0][1]
    return right / total


def test_the_copying_start_copies_before_training(bench):
    train_eagle, eagle_induction = bench
    h, gen = 64, torch.Generator().manual_seed(0)
    table, feats, embeds, tokens = repeating_data(h, 200, 48, gen)
    fit_on, check = slice(0, 40), slice(40, 48)
    lens = [12] * 8

    random_head = make_head(train_eagle, h, table, 0)
    head = make_head(train_eagle, h, table, 0)
    fit = eagle_induction.induction_init(head, feats[fit_on], embeds[fit_on], table)
    assert fit["key_fit_r2"] > 0.5 and fit["copy_decode_top1"] > 0.5

    args = (feats[check], embeds[check], tokens[check], lens)
    assert eagle_induction.copy_attention_hits(head, *args) > 0.8
    assert eagle_induction.copy_attention_hits(random_head, *args) < 0.3
    assert first_draft_top1(train_eagle, head, *args[:3], 12) > 0.6
    assert first_draft_top1(train_eagle, random_head, *args[:3], 12) < 0.2


def test_no_slow_rotary_dims_is_a_clear_error(bench):
    train_eagle, eagle_induction = bench
    assert eagle_induction.slow_rotary_dims(128, 1e6) == list(range(33, 64)) + list(range(97, 128))
    table = torch.randn(50, 64)
    head = make_head(train_eagle, 64, table, 0)
    head.theta = 100.0
    with pytest.raises(ValueError, match="rotary dims that turn slowly"):
        eagle_induction.induction_init(head, [torch.randn(5, 192)], [torch.randn(5, 64)], table)
