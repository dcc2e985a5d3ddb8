"""Packed sequences and token-budget micro-batches on 2 FSDP2 ranks (gloo) equal 1 padded rank with fixed
micro-batches: log-probs, entropies, values, one actor and critic update with the run's own losses (policy
loss, KL loss, entropy bonus; clipped value loss), and the loss metrics they log. Rank 0 holds the long rows
and rank 1 the short ones, so under the token budget rank 0 runs 4 micro-batches and rank 1 one: the FSDP
all-gathers and reduce-scatters of each forward and backward must still line up (or the run hangs), and a
per-micro-batch mean would weigh rank 1's single micro-batch as much as rank 0's four."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import spawn
from rows import fsdp2_engine, rows_with_lengths

pytestmark = pytest.mark.dist

PROMPT = [12, 10, 9, 11, 2, 1, 3, 2]  # rows 0-3 (rank 0): 18-22 valid tokens; rows 4-7 (rank 1): 3-5
RESP = [10, 10, 9, 10, 1, 3, 2, 1]
BUDGET = 25  # tokens per micro-batch: rank 0 cuts 4 micro-batches, rank 1 one
LR = 1e-4


def _batch(vocab: int):
    batch = rows_with_lengths(PROMPT, RESP, vocab, seed=2)
    g = torch.Generator().manual_seed(3)
    batch["ref_logp"] = -5.0 - torch.rand(batch["advantages"].shape, generator=g)  # [n, R]
    batch["values"] = batch["returns"] + 0.3 * torch.randn(batch["returns"].shape, generator=g)  # [n, R]
    return batch


def _losses(mode: str):
    """The run's actor and critic losses with a KL loss and an entropy bonus, aggregated by ``mode``."""
    from spmdrl.config import Config
    from spmdrl.objectives import actor_loss_fn, critic_loss_fn

    cfg = Config()
    cfg.actor.use_kl_loss, cfg.actor.kl_loss_type, cfg.actor.entropy_coeff = True, "low_var_kl", 0.01
    cfg.actor.loss_agg_mode = mode
    return actor_loss_fn(cfg), critic_loss_fn(cfg)


def _run(rank: int, world: int, model_dir: str, result: str) -> None:
    from spmdrl.engines.base import micro_batches
    from spmdrl.parallel import ParallelDims

    dims = ParallelDims(world).build()
    batch = _batch(2048)
    n = len(batch) // world
    mine = batch.select(slice(rank * n, (rank + 1) * n))
    packed = world > 1
    kw = dict(max_token_len=BUDGET) if packed else {}
    out: dict = {"micros": len(micro_batches(mine, BUDGET))}
    for role, loss in zip(("actor", "critic"), _losses("token-mean")):
        eng = fsdp2_engine(model_dir, role, dims=dims, lr=LR, remove_padding=packed)
        out[role] = eng.forward_no_grad(mine, 4, with_entropy=True, **kw)
        out[f"{role}_metrics"] = eng.train_step(mine, loss, mini_batch_size=n, micro_batch_size=4, **kw)
        out[f"{role}_weights"] = {k: v.clone() for k, v in eng.export_weights()}
        del eng
    # Loss metrics of the other aggregations (one padded rank: micro-batches of 1 row this time).
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        eng = fsdp2_engine(model_dir, dims=dims, lr=LR, remove_padding=packed)
        out[mode] = eng.train_step(mine, _losses(mode)[0], mini_batch_size=n, micro_batch_size=1, **kw)
        del eng
    if packed:  # TP=2: both ranks of the replica gather its rows and run the same packed forward
        tp_dims = ParallelDims(world, tp=2).build()
        eng = fsdp2_engine(model_dir, dims=tp_dims, lr=LR, remove_padding=True)
        out["tp"] = eng.forward_no_grad(mine, 4, **kw)
        eng.train_step(mine, _losses("token-mean")[0], mini_batch_size=n, micro_batch_size=4, **kw)
        out["tp_weights"] = {k: v.clone() for k, v in eng.export_weights()}
    torch.save(out, f"{result}.{rank}")


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("packing")
    spawn(_run, 1, str(tiny_model_dir), str(tmp / "one"))
    spawn(_run, 2, str(tiny_model_dir), str(tmp / "two"))
    return {"one": torch.load(tmp / "one.0"), "two": [torch.load(tmp / f"two.{r}") for r in (0, 1)]}


def test_ranks_cut_different_numbers_of_micro_batches(runs):
    assert [r["micros"] for r in runs["two"]] == [4, 1]


def test_packed_token_budget_outputs_equal_one_padded_rank(runs):
    one, two = runs["one"], runs["two"]
    mask = _batch(2048)["response_mask"]
    for role, keys in (("actor", ("logp", "entropy")), ("critic", ("values",))):
        for k in keys:
            got = torch.cat([two[0][role][k], two[1][role][k]])
            assert float(((got - one[role][k]) * mask).abs().max()) < 1e-5


def test_packed_token_budget_update_equals_one_padded_rank(runs):
    one, two = runs["one"], runs["two"]
    for role in ("actor", "critic"):
        a, b = one[f"{role}_weights"], two[0][f"{role}_weights"]
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def test_packed_under_tensor_parallelism_equals_one_padded_rank(runs):
    one, two = runs["one"], runs["two"]
    got = torch.cat([two[0]["tp"]["logp"], two[1]["tp"]["logp"]])
    assert float(((got - one["actor"]["logp"]) * _batch(2048)["response_mask"]).abs().max()) < 1e-5
    a, b = one["actor_weights"], two[0]["tp_weights"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4  # as test_fsdp2's TP bound


def test_loss_metrics_are_the_batch_s_whatever_the_micro_batching_and_world(runs):
    """Each logged loss is the mini-batch's loss whose gradient is taken (shares of it summed over
    micro-batches and ranks), so 1 padded rank with fixed micro-batches and 2 packed ranks with a token
    budget (4 micro-batches against 1) log the same numbers."""
    one, two = runs["one"], runs["two"]
    keys = {"actor_metrics": ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac",
                              "actor/ppo_kl"),
            "critic_metrics": ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"),
            "seq-mean-token-mean": ("actor/pg_loss", "actor/kl_loss", "actor/entropy"),
            "seq-mean-token-sum-norm": ("actor/pg_loss", "actor/kl_loss", "actor/entropy")}
    for part, names in keys.items():
        for name in names:
            a, b = one[part][name], two[0][part][name]
            assert b == two[1][part][name]  # every rank logs the same
            assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (part, name, a, b)
    assert one["actor_metrics"]["actor/kl_loss"] > 0.1 and one["critic_metrics"]["critic/vf_clipfrac"] > 0

