"""FSDP2 engine on gloo: 1 rank vs 2 ranks (FSDP, HSDP, TP), micro-batching, log-probs, export, critic, DCP.

Two spawns serve every test: a 1-rank reference run and one 2-rank run that
builds each layout in turn. The tests then compare what they returned.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from dist_utils import spawn
from rows import fsdp2_engine

if TYPE_CHECKING:
    from spmdrl.batch import Batch

pytestmark = pytest.mark.dist

N, P, R = 8, 6, 5  # global rows, prompt length, response length
LR = 1e-4


def make_batch(vocab: int) -> "Batch":
    """8 rows with varied prompt (left-padded) and response (right-padded) lengths, and signed advantages."""
    from spmdrl.batch import Batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (N, P + R), generator=g)  # [N, P+R]
    prompt_len = torch.tensor([6, 4, 5, 3, 6, 2, 5, 4])
    resp_len = torch.tensor([5, 3, 1, 4, 2, 5, 3, 4])
    pos = torch.arange(P + R)
    attn = ((pos >= P - prompt_len[:, None]) & (pos < P + resp_len[:, None])).long()  # [N, P+R]
    ids = ids * attn  # pad id 0
    resp_mask = attn[:, P:].float()  # [N, R]
    adv = torch.randn(N, 1, generator=g).expand(N, R).contiguous()  # [N, R]
    position_ids = (attn.cumsum(1) - 1).clamp(min=0)
    return Batch(
        dict(
            input_ids=ids,
            attention_mask=attn,
            position_ids=position_ids,
            response_mask=resp_mask,
            advantages=adv,
            returns=torch.randn(N, R, generator=g),
            values=torch.zeros(N, R),
        )
    )


def pg_loss(outputs, mb, scale):
    """Token-mean of −logp·adv over the mini-batch's global token count."""
    loss = -(outputs["logp"] * mb["advantages"] * mb["response_mask"]).sum() / scale.global_tokens
    return loss, {"actor/pg_loss": loss.item()}


def vf_loss(outputs, mb, scale):
    err = (outputs["values"] - mb["returns"]) ** 2 * mb["response_mask"]
    loss = 0.5 * err.sum() / scale.global_tokens
    return loss, {"critic/vf_loss": loss.item(), "critic/vpred_mean": outputs["values"].mean().item()}


def _export(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.export_weights()}


def _dp_coords(engine) -> list[tuple[int, int]]:
    """(dp_size, dp_rank) of every rank, in rank order."""
    import torch.distributed as dist

    coords: list = [None] * dist.get_world_size()
    dist.all_gather_object(coords, (engine.dp_size, engine.dp_rank))
    return coords


def _one_rank(rank: int, world: int, model_dir: str, result: str) -> None:
    from spmdrl.parallel import ParallelDims

    dims = ParallelDims(world).build()
    batch = make_batch(2048)
    out = {}
    for micro in (4, 8):
        eng = fsdp2_engine(model_dir, dims=dims, lr=LR)
        if micro == 8:
            out["init"] = _export(eng)
        metrics = eng.train_step(batch, pg_loss, mini_batch_size=N, micro_batch_size=micro)
        out[f"micro{micro}"] = _export(eng)
        out[f"metrics{micro}"] = metrics
    torch.save(out, result)


def _two_ranks(rank: int, world: int, model_dir: str, ckpt_dir: str, result: str) -> None:
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from spmdrl.config import Config
    from spmdrl.engines import build_engine
    from spmdrl.parallel import ParallelDims

    batch = make_batch(2048)
    mine = batch.select(
        slice(rank * N // 2, (rank + 1) * N // 2)
    )  # this rank's rows, as the loop shards them
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out: dict = {}

    # --- FSDP over 2 ranks: log-probs, export, one step, checkpoint round trip.
    dims = ParallelDims(world).build()
    eng = fsdp2_engine(model_dir, dims=dims, lr=LR)
    out["dp_fsdp"] = _dp_coords(eng)
    got = eng.forward_no_grad(mine, micro_batch_size=3, with_entropy=True)
    with torch.no_grad():
        logits = (
            hf(
                input_ids=mine["input_ids"],
                attention_mask=mine["attention_mask"],
                position_ids=mine["position_ids"],
            )
            .logits[:, P - 1 : P + R - 1]
            .float()
        )  # [n, R, V]
    ref_logp = torch.log_softmax(logits, -1).gather(-1, mine["input_ids"][:, P:, None]).squeeze(-1)
    ref_ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    out["logp_err"] = float((got["logp"] - ref_logp).abs().max())
    out["entropy_err"] = float((got["entropy"] - ref_ent).abs().max())
    exported = _export(eng)
    hf_sd = hf.state_dict()
    out["export_names"] = list(exported)
    out["hf_names"] = list(hf_sd)
    out["export_shapes_ok"] = all(exported[k].shape == hf_sd[k].shape for k in exported)
    out["export_err"] = max(float((exported[k] - hf_sd[k]).abs().max()) for k in exported)
    out["fsdp_metrics"] = eng.train_step(mine, pg_loss, mini_batch_size=N // 2, micro_batch_size=2)
    out["fsdp"] = _export(eng)
    dcp.save(eng.state_dict(), checkpoint_id=ckpt_dir)
    eng.offload()  # around a rollout: the state leaves the device and comes back unchanged
    eng.onload()
    eng.train_step(mine, pg_loss, mini_batch_size=N // 2, micro_batch_size=2)
    # A fresh engine's state is the load template.
    state = fsdp2_engine(model_dir, dims=dims, lr=LR).state_dict()
    dcp.load(state, checkpoint_id=ckpt_dir)
    eng.load_state_dict(state)
    out["restored_step"] = eng.global_step
    out["restored"] = _export(eng)
    del eng

    # --- Activation checkpointing recomputes the same gradients.
    eng = fsdp2_engine(model_dir, dims=dims, lr=LR, gradient_checkpointing=True)
    eng.train_step(mine, pg_loss, mini_batch_size=N // 2, micro_batch_size=2)
    out["ac"] = _export(eng)
    del eng

    # --- Frozen reference, CPU-offloaded: same log-probs, no training.
    ref = fsdp2_engine(model_dir, "ref", dims=dims, lr=LR, cpu_offload=True)
    out["ref_logp_err"] = float(
        (ref.forward_no_grad(mine, micro_batch_size=4)["logp"] - ref_logp).abs().max()
    )
    try:
        ref.train_step(mine, pg_loss, mini_batch_size=N // 2, micro_batch_size=2)
        out["ref_train_error"] = None
    except ValueError as err:
        out["ref_train_error"] = str(err)
    del ref

    # --- bf16 compute and bf16 gradient reduce-scatter over gloo.
    eng = fsdp2_engine(model_dir, dims=dims, lr=LR, param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    bf16_logp = eng.forward_no_grad(mine, micro_batch_size=4)["logp"]
    out["bf16_logp_err"] = float((bf16_logp - ref_logp).abs().max())
    # A bf16-compute reference keeps bf16 weights (no float32 master) and scores exactly like the
    # policy's per-forward cast.
    ref = fsdp2_engine(model_dir, "ref", dims=dims, lr=LR, param_dtype=torch.bfloat16)
    out["bf16_ref_dtypes"] = sorted({str(p.dtype) for p in ref.model.parameters()})
    out["bf16_ref_vs_actor"] = float((ref.forward_no_grad(mine, micro_batch_size=4)["logp"]
                                      - bf16_logp).abs().max())
    del ref
    out["bf16_metrics"] = eng.train_step(mine, pg_loss, mini_batch_size=N // 2, micro_batch_size=2)
    out["bf16"] = _export(eng)
    del eng

    # --- HSDP: 2 replicas of 1 shard.
    dims = ParallelDims(world, dp_replicate=2, dp_shard=1).build()
    eng = fsdp2_engine(model_dir, dims=dims, lr=LR)
    out["dp_hsdp"] = _dp_coords(eng)
    eng.train_step(mine, pg_loss, mini_batch_size=N // 2, micro_batch_size=2)
    out["hsdp"] = _export(eng)
    del eng

    # --- TP=2 (dp=1): the engine gathers the TP group's rows; 8 rows in micro-batches of 4.
    dims = ParallelDims(world, tp=2).build()
    eng = fsdp2_engine(model_dir, dims=dims, lr=LR)
    out["dp_tp"] = _dp_coords(eng)
    got = eng.forward_no_grad(mine, micro_batch_size=4)
    out["tp_logp_err"] = float((got["logp"] - ref_logp).abs().max())
    eng.train_step(mine, pg_loss, mini_batch_size=N // 2, micro_batch_size=4)
    out["tp"] = _export(eng)
    del eng

    # --- Critic through the config-driven builder.
    cfg = Config()
    cfg.critic.lr = LR
    dims = ParallelDims(world).build()
    critic = build_engine(
        cfg, model_dir, role="critic", dims=dims, device=torch.device("cpu"), total_steps=10
    )
    values = critic.forward_no_grad(mine, micro_batch_size=4)["values"]
    out["values_shape"] = tuple(values.shape)
    out["critic_metrics"] = critic.train_step(mine, vf_loss, mini_batch_size=N // 2, micro_batch_size=2)
    after = critic.forward_no_grad(mine, micro_batch_size=4)["values"]
    out["critic_changed"] = float((after - values).abs().max())
    if rank == 0:
        torch.save(out, result)


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("fsdp2")
    # Results go through files: tensors put on spawn's queue die with the child's shared-memory handles.
    spawn(_one_rank, 1, str(tiny_model_dir), str(tmp / "one.pt"))
    spawn(_two_ranks, 2, str(tiny_model_dir), str(tmp / "ckpt"), str(tmp / "two.pt"))
    return {"one": torch.load(tmp / "one.pt"), "two": torch.load(tmp / "two.pt")}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_micro_batching_does_not_change_the_update(runs):
    one = runs["one"]
    assert _max_diff(one["micro4"], one["micro8"]) < 1e-5
    assert _max_diff(one["init"], one["micro8"]) > 0.5 * LR  # the step moved the weights
    assert one["metrics4"]["actor/grad_norm"] == pytest.approx(one["metrics8"]["actor/grad_norm"], rel=1e-5)
    assert one["metrics8"]["actor/lr"] == pytest.approx(LR)


def test_one_rank_equals_two_ranks_fsdp_and_hsdp(runs):
    one, two = runs["one"], runs["two"]
    assert _max_diff(one["micro4"], two["fsdp"]) < 1e-5
    assert _max_diff(one["micro4"], two["hsdp"]) < 1e-5
    # fp32 norms of 4.5M entries summed in a different order (per shard, then across ranks).
    assert two["fsdp_metrics"]["actor/grad_norm"] == pytest.approx(
        one["metrics4"]["actor/grad_norm"], rel=1e-4
    )


def test_data_parallel_coordinates(runs):
    two = runs["two"]
    assert two["dp_fsdp"] == [(2, 0), (2, 1)]
    assert two["dp_hsdp"] == [(2, 0), (2, 1)]  # 2 replicas x 1 shard
    assert two["dp_tp"] == [(1, 0), (1, 0)]  # one TP group: a single replica


def test_forward_no_grad_matches_transformers(runs):
    assert runs["two"]["logp_err"] < 1e-5
    assert runs["two"]["entropy_err"] < 1e-5


def test_export_weights_names_shapes_values(runs):
    two = runs["two"]
    # The tied lm_head.weight is deliberately not exported (it is model.embed_tokens.weight).
    assert two["export_names"] == [k for k in two["hf_names"] if k != "lm_head.weight"]
    assert two["export_shapes_ok"]
    assert two["export_err"] == 0.0


def test_checkpoint_round_trip(runs):
    two = runs["two"]
    assert two["restored_step"] == 1
    assert _max_diff(two["restored"], two["fsdp"]) == 0.0


def test_activation_checkpointing_same_update(runs):
    assert _max_diff(runs["two"]["ac"], runs["two"]["fsdp"]) < 1e-5


def test_frozen_offloaded_reference(runs):
    two = runs["two"]
    assert two["ref_logp_err"] < 1e-5
    assert two["ref_train_error"] is not None and "frozen" in two["ref_train_error"]


def test_bf16_mixed_precision_on_gloo(runs):
    two = runs["two"]
    assert two["bf16_logp_err"] < 0.1  # bf16 logits: ~3 significant digits
    assert two["bf16_ref_dtypes"] == ["torch.bfloat16"] and two["bf16_ref_vs_actor"] == 0.0
    assert two["bf16_metrics"]["actor/grad_norm"] == pytest.approx(
        runs["one"]["metrics4"]["actor/grad_norm"], rel=0.05
    )
    # Master weights stay fp32 and take nearly the fp32 step.
    assert all(v.dtype == torch.float32 for v in two["bf16"].values())
    # Adam's first step is ~lr·sign(g): bf16 may flip the sign of tiny gradients, but only of a few.
    far = sum(int(((two["bf16"][k] - v).abs() > LR / 2).sum()) for k, v in runs["one"]["micro4"].items())
    assert far / sum(v.numel() for v in two["bf16"].values()) < 0.01


def test_critic_step(runs):
    two = runs["two"]
    assert two["values_shape"] == (N // 2, R)
    m = two["critic_metrics"]
    assert {"critic/vf_loss", "critic/vpred_mean", "critic/grad_norm", "critic/lr"} <= m.keys()
    assert m["critic/grad_norm"] > 0
    assert two["critic_changed"] > 0


def test_tensor_parallel_matches_one_rank(runs):
    assert runs["two"]["tp_logp_err"] < 1e-5
    assert _max_diff(runs["one"]["micro4"], runs["two"]["tp"]) < 1e-4
