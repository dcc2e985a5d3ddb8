"""Packed sequences (model.use_remove_padding) and token-budget micro-batches (actor.use_dynamic_bsz) on one
rank: log-probs, entropies, values, reward scores and one optimizer update equal the padded, fixed path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rows import fsdp2_engine as _engine
from rows import pg_loss, rows_with_lengths, vf_loss

from spmdrl.batch import Batch

P, R = 12, 10
PROMPT = [12, 2, 7, 1, 12, 5]  # very different lengths: 3 to 22 valid tokens of 22 columns
RESP = [10, 1, 6, 2, 10, 4]

pytestmark = pytest.mark.usefixtures("gloo_world_of_one")


def long_tailed_batch(vocab: int, prompt: list[int] = PROMPT, resp: list[int] = RESP) -> Batch:
    return rows_with_lengths(prompt, resp, vocab, seed=1)


def _weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.export_weights()}


def _close_on_mask(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b) * mask).abs().max())


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_forward_and_update_equal_padded(tiny_model_dir: Path, attn: str):
    batch = long_tailed_batch(2048)
    mask = batch["response_mask"]
    padded, packed = (_engine(tiny_model_dir, attn_implementation=attn, remove_padding=rp)
                      for rp in (False, True))
    a = padded.forward_no_grad(batch, 4, with_entropy=True)
    b = packed.forward_no_grad(batch, 4, with_entropy=True)
    assert _close_on_mask(a["logp"], b["logp"], mask) < 1e-5
    assert _close_on_mask(a["entropy"], b["entropy"], mask) < 1e-5
    assert torch.isfinite(b["logp"]).all()  # padding columns hold finite values, as the padded path's
    if attn == "sdpa":
        return  # the update goes through the same packing; once is enough
    for eng in (padded, packed):
        eng.train_step(batch, pg_loss, mini_batch_size=6, micro_batch_size=4)
    wa, wb = _weights(padded), _weights(packed)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5
    init = _weights(_engine(tiny_model_dir))
    assert max(float((wa[k] - init[k]).abs().max()) for k in wa) > 5e-5  # the update moved the weights


def test_packed_critic_values_and_update_equal_padded(tiny_model_dir: Path):
    batch = long_tailed_batch(2048)
    mask = batch["response_mask"]
    padded, packed = (_engine(tiny_model_dir, "critic", remove_padding=rp) for rp in (False, True))
    va = padded.forward_no_grad(batch, 4)["values"]
    vb = packed.forward_no_grad(batch, 4)["values"]
    assert va.shape == vb.shape == mask.shape
    assert _close_on_mask(va, vb, mask) < 1e-5
    for eng in (padded, packed):
        eng.train_step(batch, vf_loss, mini_batch_size=6, micro_batch_size=4)
    wa, wb = _weights(padded), _weights(packed)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5


def test_packed_reward_scores_equal_padded(tiny_model_dir: Path):
    from spmdrl.builtin.models import build_model

    rm_dir = build_model(tiny_model_dir.parent / "tiny_rm", "tiny", seed=0, reward=True)
    rows = long_tailed_batch(2048)  # the reward model's rows have no response mask (reward/model.py)
    batch = Batch({k: rows[k] for k in ("input_ids", "attention_mask", "position_ids")})
    padded, packed = (_engine(rm_dir, "reward", remove_padding=rp) for rp in (False, True))
    sa = padded.forward_no_grad(batch, 4)["rm_scores"]
    sb = packed.forward_no_grad(batch, 4)["rm_scores"]
    assert sa.shape == (len(batch),) and float((sa - sb).abs().max()) < 1e-5


def test_micro_batches_stay_within_the_token_budget():
    from spmdrl.engines.base import micro_batches

    batch = long_tailed_batch(100)  # valid tokens per row: 22, 3, 13, 3, 22, 9
    sizes = [len(m) for m in micro_batches(batch, 25)]
    assert sizes == [2, 2, 1, 1]  # 22+3 | 13+3 | 22 | 9
    assert [len(m) for m in micro_batches(batch, 10)] == [1, 1, 1, 1, 1, 1]
    assert [len(m) for m in micro_batches(batch, 1000)] == [6]
    rows = torch.cat([m["input_ids"] for m in micro_batches(batch, 25)])
    assert torch.equal(rows, batch["input_ids"])  # order kept


@pytest.mark.parametrize("remove_padding", [False, True])
def test_token_budget_micro_batches_equal_fixed(tiny_model_dir: Path, remove_padding: bool):
    batch = long_tailed_batch(2048)
    fixed, dynamic = (_engine(tiny_model_dir, remove_padding=remove_padding) for _ in range(2))
    a = fixed.forward_no_grad(batch, 2, with_entropy=True)
    b = dynamic.forward_no_grad(batch, 2, with_entropy=True, max_token_len=25)
    for k in a:
        assert float((a[k] - b[k]).abs().max()) < 1e-5
    fixed.train_step(batch, pg_loss, mini_batch_size=6, micro_batch_size=2)
    dynamic.train_step(batch, pg_loss, mini_batch_size=6, micro_batch_size=2, max_token_len=25)
    wa, wb = _weights(fixed), _weights(dynamic)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5
