"""Sequence parallelism (Ulysses, spmdrl/engines/fsdp2/ulysses.py) equals SP 1, float32 on gloo: SP 2 on 2
ranks and dp 2 x sp 2 on 4 ranks against one packed rank, for the actor's log-probs and entropy, the
critic's values, the reward model's scores, one actor and one critic update with the run's own losses (their
loss metrics and grad norms), and the parameters after them; at SP 2 also LoRA with activation
checkpointing under a token budget.

The rows are laid out so that the first micro-batch's packed row (32 tokens) is cut by SP 2 inside a
response: the last token of rank 0's slice predicts the first token of rank 1's (the shard-boundary target
that verl #6068 got wrong), and the second micro-batch's row (25 tokens) is padded to a multiple of sp. A
model with one key/value head runs at SP 2 too, which repeats its key/value heads to the query heads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import assert_metrics_close, spawn
from rows import fsdp2_engine, rows_with_lengths

pytestmark = pytest.mark.dist

PROMPT = [5, 3, 4, 2, 2, 6, 3, 1]  # micro-batch 0 (rows 0-3): 11 + 8 + 7 + 6 = 32 tokens
RESP = [6, 5, 3, 4, 3, 2, 6, 2]  # micro-batch 1 (rows 4-7): 5 + 8 + 9 + 3 = 25 tokens
MICRO, LR = 4, 1e-4
TOL = 1e-5
# The grad norm's squares are summed shard by shard: 2 ranks without SP differ from 1 rank by 4e-6 of it, and
# 4 ranks (dp 2 x sp 2) by 1.1e-5, SP or not; relative.
NORM_TOL = 2e-5


def _batch(vocab: int = 2048):
    batch = rows_with_lengths(PROMPT, RESP, vocab, seed=2)
    g = torch.Generator().manual_seed(3)
    # Near the random model's own log-probs (about -log 2048): a KL loss of a trained policy's size.
    batch["ref_logp"] = -7.6 - 0.2 * torch.rand(batch["advantages"].shape, generator=g)  # [n, R]
    batch["values"] = batch["returns"] + 0.3 * torch.randn(batch["returns"].shape, generator=g)  # [n, R]
    return batch


def _losses():
    from spmdrl.config import Config
    from spmdrl.objectives import actor_loss_fn, critic_loss_fn

    cfg = Config()
    cfg.actor.use_kl_loss, cfg.actor.kl_loss_type, cfg.actor.entropy_coeff = True, "low_var_kl", 0.01
    return actor_loss_fn(cfg), critic_loss_fn(cfg)


def _run(rank: int, world: int, sp: int, models: dict[str, str]) -> dict:
    """Every output and update on this rank's rows (the batch sharded over the world in rank order)."""
    from spmdrl.parallel import ParallelDims

    dims = ParallelDims(world, sp=sp).build()
    batch = _batch()
    n = len(batch) // world
    mine = batch.select(slice(rank * n, (rank + 1) * n))
    out: dict = {}
    for role, loss in zip(("actor", "critic"), _losses()):
        eng = fsdp2_engine(models["tiny"], role, dims=dims, lr=LR, remove_padding=True)
        out[role] = eng.forward_no_grad(mine, MICRO, with_entropy=True)
        out[f"{role}_metrics"] = eng.train_step(mine, loss, mini_batch_size=n, micro_batch_size=MICRO)
        out[f"{role}_weights"] = {k: v.clone() for k, v in eng.export_weights()}
        del eng
    eng = fsdp2_engine(models["rm"], "reward", dims=dims, remove_padding=True)
    out["reward"] = eng.forward_no_grad(mine, MICRO)
    if world <= 2:
        from spmdrl.engines.fsdp2.lora import LoraSpec

        variants = {
            "mqa": (models["mqa"], {}, {}),  # one key/value head: repeated to the query heads at SP 2
            # LoRA adapters, activation checkpointing, and micro-batches cut by a token budget (per rank)
            "lora": (models["tiny"], dict(lora=LoraSpec(8, 16), gradient_checkpointing=True),
                     dict(max_token_len=24 // sp)),
        }
        for name, (model, kw, budget) in variants.items():
            eng = fsdp2_engine(model, dims=dims, lr=LR, remove_padding=True, **kw)
            out[name] = eng.forward_no_grad(mine, MICRO, with_entropy=True, **budget)
            out[f"{name}_metrics"] = eng.train_step(mine, _losses()[0], mini_batch_size=n,
                                                    micro_batch_size=MICRO, **budget)
            out[f"{name}_weights"] = {k: v.clone() for k, v in eng.export_weights()}
            cut = eng._micro_batches(eng._gather(mine), MICRO, budget.get("max_token_len"))[0]
            out[f"{name}_micros"] = len(cut)
    return out


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from spmdrl.builtin.models import build_model

    tmp = tmp_path_factory.mktemp("sp")
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_key_value_heads = 1
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "mqa")
    models = {"tiny": str(tiny_model_dir), "rm": str(build_model(tmp / "rm", "tiny", seed=3, reward=True)),
              "mqa": str(tmp / "mqa")}
    return {"one": spawn(_run, 1, 1, models)[0], "sp2": spawn(_run, 2, 2, models),
            "dp2sp2": spawn(_run, 4, 2, models)}


def _rows(per_rank: list[dict], role: str, key: str) -> torch.Tensor:
    return torch.cat([r[role][key] for r in per_rank])


def test_the_first_micro_batch_is_cut_inside_a_response():
    from spmdrl.engines.fsdp2.packing import pack

    packed = pack(_batch().select(slice(0, MICRO)))
    cut = packed.input_ids.shape[1] // 2  # SP 2: rank 1's slice starts here
    # The position before the cut predicts a response token (the first of rank 1's slice).
    assert cut - 1 in packed.keep.tolist()


@pytest.mark.parametrize("layout", ["sp2", "dp2sp2"])
def test_outputs_equal_sp_1(runs, layout):
    one, many = runs["one"], runs[layout]
    mask = _batch()["response_mask"]
    for role, keys in (("actor", ("logp", "entropy")), ("critic", ("values",))):
        for k in keys:
            assert float(((_rows(many, role, k) - one[role][k]) * mask).abs().max()) < TOL, (role, k)
    assert float((_rows(many, "reward", "rm_scores") - one["reward"]["rm_scores"]).abs().max()) < TOL


@pytest.mark.parametrize("layout", ["sp2", "dp2sp2"])
def test_an_update_equals_sp_1(runs, layout):
    """Every loss metric and the grad norm (relative), and the parameters after the update."""
    one, many = runs["one"], runs[layout]
    for role in ("actor", "critic"):
        for r in many:
            assert_metrics_close(one[f"{role}_metrics"], r[f"{role}_metrics"], TOL, NORM_TOL)
        w1, w2 = one[f"{role}_weights"], many[0][f"{role}_weights"]
        assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < TOL, role
    assert one["actor_metrics"]["actor/kl_loss"] > 1e-3 and one["critic_metrics"]["critic/vf_clipfrac"] > 0


@pytest.mark.parametrize("variant", ["mqa", "lora"])
def test_repeated_kv_heads_lora_checkpointing_and_token_budgets_equal_sp_1(runs, variant):
    """One key/value head; LoRA with activation checkpointing under a token budget that SP 2 doubles per
    group (so both cut the same 3 micro-batches: 24 tokens on one rank, 12 a rank on two)."""
    one, two = runs["one"], runs["sp2"]
    mask = _batch()["response_mask"]
    for k in ("logp", "entropy"):
        assert float(((_rows(two, variant, k) - one[variant][k]) * mask).abs().max()) < TOL, k
    assert_metrics_close(one[f"{variant}_metrics"], two[0][f"{variant}_metrics"], TOL, NORM_TOL)
    w1, w2 = one[f"{variant}_weights"], two[0][f"{variant}_weights"]
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < TOL
    if variant == "lora":
        assert one["lora_micros"] == two[0]["lora_micros"] > 2
