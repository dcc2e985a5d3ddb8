"""Mixture-of-Experts on the FSDP2 engine (``builtin:tiny-moe``, Qwen3-MoE: 8 experts, 2 routed a token),
float32 on gloo: the same update on 1 and 2 ranks, and an update where every token is routed to the same
2 experts (so 6 experts get no token on any rank) that neither hangs nor moves those 6.

transformers stores a layer's experts as fused [experts, ...] tensors, and FSDP2 shards them with the rest
of the layer and gathers the whole layer for its forward: an expert without tokens is still part of every
rank's collectives (pytorch #158719 and slime PR #1010 hung on per-expert collectives instead).
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import assert_metrics_close, spawn
from rows import fsdp2_engine, rows_with_lengths

pytestmark = pytest.mark.dist

PROMPT = [5, 3, 4, 2, 2, 6, 3, 1]
RESP = [6, 5, 3, 4, 3, 2, 6, 2]
MICRO, LR, TOL = 4, 1e-3, 1e-5
NORM_TOL = 2e-5  # relative: the grad norm's squares are summed shard by shard (test_sp_dist.py)


def _loss():
    from spmdrl.config import Config
    from spmdrl.objectives import actor_loss_fn

    cfg = Config()
    cfg.actor.use_kl_loss, cfg.actor.entropy_coeff = True, 0.01
    return actor_loss_fn(cfg)


def _batch():
    batch = rows_with_lengths(PROMPT, RESP, 2048, seed=2)
    batch["ref_logp"] = -7.6 - 0.2 * torch.rand(batch["advantages"].shape,
                                                generator=torch.Generator().manual_seed(3))  # [n, R]
    return batch


def _run(rank: int, world: int, models: dict[str, str]) -> dict:
    """Log-probs, one update's metrics and the weights after it, for each model, on this rank's rows."""
    from spmdrl.parallel import ParallelDims

    dims = ParallelDims(world).build()
    batch = _batch()
    n = len(batch) // world
    mine = batch.select(slice(rank * n, (rank + 1) * n))
    out: dict = {}
    for name, path in models.items():
        eng = fsdp2_engine(path, dims=dims, lr=LR, remove_padding=True)
        out[name] = {k: v.numpy() for k, v in eng.forward_no_grad(mine, MICRO, with_entropy=True).items()}
        out[f"{name}_metrics"] = eng.train_step(mine, _loss(), mini_batch_size=n, micro_batch_size=MICRO)
        out[f"{name}_weights"] = {k: v.clone().numpy() for k, v in eng.export_weights()}
        del eng
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from transformers import AutoModelForCausalLM

    from spmdrl.builtin.models import build_model

    tmp = tmp_path_factory.mktemp("moe")
    moe = build_model(tmp / "tiny-moe", "tiny-moe", seed=0)
    # The router's weights zeroed: every logit is 0, so every token of every rank goes to the same 2 experts
    # (the pair top-k picks among equal logits).
    skewed = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32)
    for layer in skewed.model.layers:
        layer.mlp.gate.weight.data.zero_()
    skewed.save_pretrained(tmp / "skewed")
    models = {"moe": str(moe), "skewed": str(tmp / "skewed")}
    return {"models": models, "one": spawn(_run, 1, models)[0], "two": spawn(_run, 2, models)}


def test_the_built_in_model_is_qwen3_moe_with_fused_experts(runs):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(runs["models"]["moe"])
    assert config.model_type == "qwen3_moe" and (config.num_experts, config.num_experts_per_tok) == (8, 2)
    weights = runs["one"]["moe_weights"]
    assert weights["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8  # [experts, ...]


@pytest.mark.parametrize("model", ["moe", "skewed"])
def test_an_moe_update_on_two_ranks_equals_one_rank(runs, model):
    one, two = runs["one"], runs["two"]
    mask = _batch()["response_mask"].numpy()
    for k in ("logp", "entropy"):
        both = torch.cat([torch.as_tensor(r[model][k]) for r in two])
        assert float(((both - torch.as_tensor(one[model][k])) * torch.as_tensor(mask)).abs().max()) < TOL, k
    for r in two:
        assert_metrics_close(one[f"{model}_metrics"], r[f"{model}_metrics"], TOL, NORM_TOL)
    w1, w2 = one[f"{model}_weights"], two[0][f"{model}_weights"]
    assert max(float(abs(w1[k] - w2[k]).max()) for k in w1) < TOL


def test_experts_without_tokens_do_not_move(runs):
    """Skewed routing: 2 experts take every token and train; the other 6 get no gradient on any rank and keep
    their weights exactly (AdamW without weight decay), on 1 rank and on 2."""
    from transformers import AutoModelForCausalLM

    # The folder holds one tensor per expert (the checkpoint layout); the loaded model fuses them.
    before = AutoModelForCausalLM.from_pretrained(runs["models"]["skewed"], dtype=torch.float32).state_dict()
    for after in (runs["one"]["skewed_weights"], runs["two"][0]["skewed_weights"]):
        for layer in range(4):
            for part in ("gate_up_proj", "down_proj"):
                key = f"model.layers.{layer}.mlp.experts.{part}"
                moved = (torch.as_tensor(after[key]) - before[key]).abs().flatten(1).amax(1)  # [8]
                assert int((moved > 0).sum()) == 2 and int((moved == 0).sum()) == 6, (key, moved)
