"""Mixture-of-Experts on the FSDP2 engine (``builtin:tiny-moe``, Qwen3-MoE: 8 experts, 2 routed a token),
float32 on gloo: the same update on 1 and 2 ranks, and an update where every token is routed to the same
2 experts (so 6 experts get no token on any rank) that neither hangs nor moves those 6. Routing replay
(``engines/fsdp2/moe.py``): with R3 the log-probs equal a plain transformers forward whose experts are forced
to the recorded ones, packed or padded, on 1 rank, 2 ranks and SP 2; R2 records the old-log-prob pass's
routing, which is the model's own, and its update replays it the same on 1 and 2 ranks.

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
# Weights after one update under EP, which sums a token's expert outputs in another order: AdamW's first
# step moves a weight by lr g / (|g| + eps), so the last-bit rounding of a near-zero gradient moves it by up
# to a few percent of lr (1e-3); measured 1.6e-5 on attention weights, log-probs and losses within 1e-5.
STEP_TOL = 5e-5


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


def _routes(batch) -> torch.Tensor:
    """Recorded routing [n, P+R, 4 layers, 2] of two distinct experts a token, none on every 7th token."""
    g = torch.Generator().manual_seed(4)
    n, width = batch["input_ids"].shape
    routes = torch.rand(n, width, 4, 8, generator=g).argsort(-1)[..., :2].to(torch.uint8)
    routes.view(-1, 4, 2)[::7] = 255  # ``unrouted``: the trainer's router picks these tokens' experts
    return routes


def _run(rank: int, world: int, models: dict[str, str], sp: int = 1, export: str | None = None,
         ep: int = 1) -> dict:
    """Log-probs, one update's metrics and the weights after it, for each model, on this rank's rows; then
    routing replay on the MoE model: R3 packed and padded, R2's record and its update. ``export``: where the
    MoE model after its update goes as a Hugging Face folder, and its log-probs then."""
    from pathlib import Path

    from spmdrl.checkpoint.hf_folder import write_hf_folder
    from spmdrl.parallel import ParallelDims

    dims = ParallelDims(world, sp=sp, ep=ep).build()
    batch = _batch()
    batch["routed_experts"] = _routes(batch)
    n = len(batch) // dims.dp_mesh.size()
    mine = batch.select(slice(dims.dp_mesh.get_local_rank() * n, (dims.dp_mesh.get_local_rank() + 1) * n))
    out: dict = {}
    for name, path in models.items() if sp == 1 else ():
        eng = fsdp2_engine(path, dims=dims, lr=LR, remove_padding=True)
        out[name] = {k: v.numpy() for k, v in eng.forward_no_grad(mine, MICRO, with_entropy=True).items()}
        out[f"{name}_metrics"] = eng.train_step(mine, _loss(), mini_batch_size=n, micro_batch_size=MICRO)
        out[f"{name}_weights"] = {k: v.clone().numpy() for k, v in eng.export_weights()}
        if name == "moe" and export is not None:
            weights = eng.export_weights()  # every rank gathers; rank 0 writes
            if rank == 0:
                write_hf_folder(weights, Path(export), Path(path))
            else:
                for _ in weights:
                    pass
            out["moe_updated"] = eng.forward_no_grad(mine, MICRO)["logp"].numpy()
        del eng
    for packed in (True, False) if sp == 1 else (True,):
        eng = fsdp2_engine(models["moe"], dims=dims, lr=LR, remove_padding=packed, router_replay="R3")
        out[f"r3_{packed}"] = eng.forward_no_grad(mine, MICRO)["logp"].numpy()
        out[f"r3_{packed}_metrics"] = eng.train_step(mine, _loss(), mini_batch_size=n, micro_batch_size=MICRO)
    if sp == 1:  # the load-balancing loss (actor.moe_aux_loss_coef), per micro-batch of the same rows
        eng = fsdp2_engine(models["moe"], dims=dims, lr=LR, remove_padding=True, moe_aux_loss_coef=0.5)
        out["aux_metrics"] = eng.train_step(mine, _loss(), mini_batch_size=n, micro_batch_size=MICRO)
        out["aux_router"] = dict(eng.export_weights())["model.layers.0.mlp.gate.weight"].numpy()
    eng = fsdp2_engine(models["moe"], dims=dims, lr=LR, remove_padding=True, router_replay="R2")
    old = eng.forward_no_grad(mine, MICRO)
    out["r2_routes"] = old["routed_experts"].numpy()
    mine["routed_experts"] = old["routed_experts"]
    out["r2_metrics"] = eng.train_step(mine, _loss(), mini_batch_size=n, micro_batch_size=MICRO)
    return out


def _forced_logp(path: str, batch, routes: torch.Tensor) -> torch.Tensor:
    """Log-probs [n, R] of a plain transformers forward whose every MoE layer runs transformers' own experts
    on the ``routes`` [n, P+R, L, k] (a token marked 255 on its router's top-k), weighted by the router's
    probabilities at them, renormalised: what replay means, written apart from ``moe.py``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    flat = routes.flatten(0, 1).long()  # [n*(P+R), L, k]: the padded forward's token order
    for li, layer in enumerate(model.model.layers):
        def forward(h, mlp=layer.mlp, li=li):
            x = h.reshape(-1, h.shape[-1])
            probs = torch.softmax(x @ mlp.gate.weight.T, -1)  # [T, E]
            use = torch.where(flat[:, li, :1] == 255, probs.topk(2).indices, flat[:, li])
            weights = probs.gather(-1, use)
            return mlp.experts(x, use, weights / weights.sum(-1, keepdim=True)).view_as(h)
        layer.mlp.forward = forward
    resp = batch["response_mask"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, -resp - 1:-1]  # [n, R, V]
    return torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, -resp:, None]).squeeze(-1)


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
    export = str(tmp / "exported")
    return {"models": models, "one": spawn(_run, 1, models)[0], "two": spawn(_run, 2, models, 1, export),
            "sp2": spawn(_run, 2, models, 2), "ep2": spawn(_run, 2, models, 1, None, 2), "export": export}


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


def test_r3_log_probs_are_a_forward_with_the_recorded_experts(runs):
    batch = _batch()
    mask = batch["response_mask"]
    forced = _forced_logp(runs["models"]["moe"], batch, _routes(batch))
    own = torch.as_tensor(runs["one"]["moe"]["logp"])
    assert float(((forced - own) * mask).abs().max()) > 1e-3  # the recorded experts are not the router's
    layouts = {"1 rank packed": runs["one"]["r3_True"], "1 rank padded": runs["one"]["r3_False"],
               "2 ranks packed": [r["r3_True"] for r in runs["two"]],
               "2 ranks padded": [r["r3_False"] for r in runs["two"]], "sp 2": runs["sp2"][0]["r3_True"]}
    for name, logp in layouts.items():
        logp = torch.cat([torch.as_tensor(x) for x in logp]) if isinstance(logp, list) else \
            torch.as_tensor(logp)
        assert float(((logp - forced) * mask).abs().max()) < TOL, name


def test_replayed_updates_and_routing_metrics_agree_across_layouts(runs):
    one = runs["one"]
    for key in ("r3_True_metrics", "r3_False_metrics", "r2_metrics"):
        for r in runs["two"]:
            assert_metrics_close(one[key], r[key], TOL, NORM_TOL)
    assert_metrics_close(one["r3_True_metrics"], runs["sp2"][0]["r3_True_metrics"], TOL, NORM_TOL)
    m = one["r3_True_metrics"]
    # Random recorded experts: about 2/8 of them are among the router's own top 2.
    assert 0.1 < m["actor/moe/router_agreement"] < 0.5
    assert m["actor/moe/expert_load_max_over_mean/max"] >= m["actor/moe/expert_load_max_over_mean"] >= 1
    # Replaying its own old-log-prob routing, the router agrees with all of it before its first step.
    assert one["r2_metrics"]["actor/moe/router_agreement"] > 0.9


def test_r2_records_the_routers_own_choice(runs):
    """The R2 record is each token's own top-2 (what an unforced forward routes), 255 on padding, the same
    on 1 and 2 ranks and under SP."""
    batch = _batch()
    valid = batch["attention_mask"].bool()
    own = torch.as_tensor(runs["one"]["r2_routes"])  # [n, P+R, L, k]
    assert (own[~valid] == 255).all() and (own[valid] < 8).all()
    two = torch.cat([torch.as_tensor(r["r2_routes"]) for r in runs["two"]])  # each rank's rows
    sp2 = torch.as_tensor(runs["sp2"][0]["r2_routes"])  # an SP group holds every row
    for other in (two, sp2):
        assert torch.equal(torch.sort(other, -1).values[valid], torch.sort(own, -1).values[valid])
    unforced = batch.select(slice(0, len(batch)))
    unforced["routed_experts"] = own
    logp = _forced_logp(runs["models"]["moe"], unforced, own)  # replaying its own routing changes nothing
    plain = torch.as_tensor(runs["one"]["moe"]["logp"])
    assert float(((logp - plain) * batch["response_mask"]).abs().max()) < TOL


def test_an_exported_moe_run_loads_in_transformers_with_its_log_probs(runs):
    """The MoE model after its update on 2 ranks, exported: one tensor an expert (the checkpoint layout),
    and transformers' log-probs of it equal the engine's after the update."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    folder = Path(runs["export"])
    names = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            names |= set(st.keys())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3_moe"
    batch = _batch()
    loaded = _forced_logp(str(folder), batch, torch.full_like(_routes(batch), 255))  # its own routing
    engine = torch.cat([torch.as_tensor(r["moe_updated"]) for r in runs["two"]])
    assert float(((loaded - engine) * batch["response_mask"]).abs().max()) < TOL


def test_the_load_balancing_loss_trains_the_router_the_same_on_one_and_two_ranks(runs):
    one, two = runs["one"], runs["two"]
    for r in two:
        assert_metrics_close(one["aux_metrics"], r["aux_metrics"], TOL, NORM_TOL)
    assert one["aux_metrics"]["actor/moe/aux_loss"] > 1  # 1 is an even load; tiny-moe's is not
    plain = one["moe_weights"]["model.layers.0.mlp.gate.weight"]
    assert float(abs(one["aux_router"] - plain).max()) > 1e-6  # the loss moved the router
    assert float(abs(two[0]["aux_router"] - one["aux_router"]).max()) < TOL


@pytest.mark.parametrize("model", ["moe", "skewed"])
def test_expert_parallel_equals_fsdp_alone(runs, model):
    """parallel.ep 2 on 2 ranks (each rank owns 4 experts, tokens go to them by all-to-all) against FSDP
    alone on 2 ranks: the same log-probs and update metrics within 1e-5, the weights after the update within
    STEP_TOL; with the skewed routing one rank's experts get no token at all, and nothing hangs."""
    for name in (model, f"{model}_metrics", f"{model}_weights"):
        for ep, plain in zip(runs["ep2"], runs["two"]):
            if name.endswith("_metrics"):
                assert_metrics_close(plain[name], ep[name], TOL, NORM_TOL)
            elif name.endswith("_weights"):  # Adam's first step is lr g / (|g| + eps): see STEP_TOL
                assert max(float(abs(plain[name][k] - ep[name][k]).max()) for k in plain[name]) < STEP_TOL
            else:
                for k in plain[name]:
                    assert float(abs(plain[name][k] - ep[name][k]).max()) < TOL, k
    for key in ("r3_True_metrics", "r2_metrics", "aux_metrics"):  # replay and balancing under EP
        for ep, plain in zip(runs["ep2"], runs["two"]):
            assert_metrics_close(plain[key], ep[key], TOL, NORM_TOL)
