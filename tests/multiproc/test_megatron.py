"""Megatron engine on gloo (CPU, megatron-core's CUDA calls redirected by spmdrl.engines.megatron.cpu).

One 2-rank spawn builds each layout in turn (tp=1 with dp=2, tp=2, pp=2) and
records: fp32 log-probs and entropies against transformers, one GRPO update
with the loop's own actor loss against the FSDP2 engine's update on the same
rows, the exported HF tensors against the folder, the native rollout
engine's log-probs after a weight sync against the updated actor's, a DCP
checkpoint saved at pp=2 and resumed at pp=1, and the critic: values before and
one PPO value-loss update (the loop's critic loss) against the FSDP2 critic's,
offload/onload around it, and its checkpoint resumed on another layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import spawn
from rows import fsdp2_engine

pytestmark = pytest.mark.dist

pytest.importorskip("megatron.core")

N, P, R = 8, 6, 5  # global rows, prompt length, response length
LR = 1e-4
LAYOUTS = {"tp1": dict(tp=1, pp=1), "tp2": dict(tp=2, pp=1), "pp2": dict(tp=1, pp=2)}


def make_batch(vocab: int):
    """8 rows with varied left-padded prompts and right-padded responses, signed group advantages."""
    from spmdrl.batch import Batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (N, P + R), generator=g)  # [N, P+R]
    prompt_len = torch.tensor([6, 4, 5, 3, 6, 2, 5, 4])
    resp_len = torch.tensor([5, 3, 1, 4, 2, 5, 3, 4])
    pos = torch.arange(P + R)
    attn = ((pos >= P - prompt_len[:, None]) & (pos < P + resp_len[:, None])).long()  # [N, P+R]
    return Batch(dict(
        input_ids=ids * attn,
        attention_mask=attn,
        position_ids=(attn.cumsum(1) - 1).clamp(min=0),
        response_mask=attn[:, P:].float(),  # [N, R]
        advantages=torch.randn(N, 1, generator=g).expand(N, R).contiguous(),  # [N, R]
        values=0.1 * torch.randn(N, R, generator=g),  # [N, R] the critic's values at rollout time
        returns=torch.randn(N, R, generator=g),  # [N, R] far from them, so the value clip is exercised
    ))


def _reference(hf, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' fp32 log-probs and entropies [n, R] of the response tokens."""
    with torch.no_grad():
        logits = hf(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"],
                    position_ids=rows["position_ids"]).logits[:, P - 1 : P + R - 1].float()  # [n, R, V]
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, rows["input_ids"][:, P:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _run(rank: int, world: int, model_dir: str, ckpt: str, result: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from spmdrl.batch import from_generation
    from spmdrl.config import Config
    from spmdrl.engines.megatron.engine import MegatronEngine
    from spmdrl.objectives import actor_loss_fn, critic_loss_fn
    from spmdrl.parallel import ParallelDims
    from spmdrl.rollout.base import SamplingParams
    from spmdrl.rollout.native.engine import NativeRollout

    batch = make_batch(2048)
    # this rank's rows, as the loop shards them
    mine = batch.select(slice(rank * N // 2, (rank + 1) * N // 2))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf_sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    ref_logp, ref_ent = _reference(hf, mine)
    cfg = Config()
    loss_fn = actor_loss_fn(cfg)  # the loop's GRPO loss: PPO clip, token-mean over the global token count
    out: dict = {}

    dims = ParallelDims(world).build()
    fsdp = fsdp2_engine(model_dir, dims=dims, lr=LR)
    out["fsdp_metrics"] = fsdp.train_step(mine, loss_fn, mini_batch_size=N // 2, micro_batch_size=2)
    out["fsdp"] = {k: v.clone() for k, v in fsdp.export_weights()}
    out["fsdp_moved"] = max(float((out["fsdp"][k] - v).abs().max()) for k, v in hf_sd.items())
    del fsdp
    vf_loss = critic_loss_fn(cfg)  # the loop's clipped value loss, token-mean over the global token count
    fsdp = fsdp2_engine(model_dir, "critic", dims=dims, lr=LR)
    out["fsdp_critic_values"] = fsdp.forward_no_grad(mine, micro_batch_size=3)["values"]
    out["fsdp_critic_metrics"] = fsdp.train_step(mine, vf_loss, mini_batch_size=N // 2, micro_batch_size=2)
    out["fsdp_critic"] = {k: v.clone() for k, v in fsdp.export_weights()}
    out["fsdp_critic_after"] = fsdp.forward_no_grad(mine, micro_batch_size=3)["values"]
    del fsdp

    rollout = NativeRollout(model_dir, mesh=None, seed=rank, eos_token_ids=[2], pad_token_id=0)
    prompts = [[1, 100 + rank, 200, 300], [1, 50, 60]]
    for name, layout in LAYOUTS.items():
        dims = ParallelDims(world, **layout).build()
        eng = MegatronEngine(model_dir, role="actor", dims=dims, lr=LR, seed=0)
        coords: list = [None] * world
        dist.all_gather_object(coords, (eng.dp_size, eng.dp_rank))
        out[f"{name}_dp"] = coords
        got = eng.forward_no_grad(mine, micro_batch_size=3, with_entropy=True)
        valid = mine["response_mask"].bool()  # past a response's end both sides score padding differently
        out[f"{name}_logp_err"] = float((got["logp"] - ref_logp)[valid].abs().max())
        out[f"{name}_entropy_err"] = float((got["entropy"] - ref_ent)[valid].abs().max())
        exported = {k: v.clone() for k, v in eng.export_weights()}
        out[f"{name}_export_names"] = sorted(exported)
        out[f"{name}_export_err"] = max(float((exported[k] - hf_sd[k]).abs().max()) for k in hf_sd)
        out[f"{name}_metrics"] = eng.train_step(mine, loss_fn, mini_batch_size=N // 2, micro_batch_size=2)
        out[name] = {k: v.clone() for k, v in eng.export_weights()}
        # Weight sync: the rollout engine, loaded with the exported weights, scores as the actor does.
        rollout.sleep(2)
        rollout.wake_up(("weights",))
        rollout.update_weights(eng.export_weights())
        rollout.wake_up(("kv_cache",))
        gen = rollout.generate(prompts, SamplingParams(n=2, max_tokens=8, temperature=1.0))
        sampled = from_generation(gen, torch.arange(len(prompts)))
        actor_logp = eng.forward_no_grad(sampled, micro_batch_size=4)["logp"]  # [n, R]
        mask = sampled["response_mask"].bool()
        out[f"{name}_sync_gap"] = float((actor_logp - gen.logprobs)[mask].abs().max())
        if name == "pp2":
            dcp.save(eng.state_dict(), checkpoint_id=ckpt)
            eng.train_step(mine, loss_fn, mini_batch_size=N // 2, micro_batch_size=2)
            out["pp2_second"] = {k: v.clone() for k, v in eng.export_weights()}
        del eng
        # The critic on the same layout: values, one value-loss update (after an offload/onload, as the
        # loop does around rollout), the values after it.
        critic = MegatronEngine(model_dir, role="critic", dims=dims, lr=LR, seed=0)
        out[f"{name}_critic_values"] = critic.forward_no_grad(mine, micro_batch_size=3)["values"]
        critic.offload()
        critic.onload()
        out[f"{name}_critic_metrics"] = critic.train_step(mine, vf_loss, mini_batch_size=N // 2,
                                                          micro_batch_size=2)
        out[f"{name}_critic"] = {k: v.clone() for k, v in critic.export_weights()}
        out[f"{name}_critic_after"] = critic.forward_no_grad(mine, micro_batch_size=3)["values"]
        if name == "pp2":
            dcp.save(critic.state_dict(), checkpoint_id=ckpt + "_critic")
        del critic

    # Resume the pp=2 checkpoint with pp=1 (dp=2): same weights, same Adam moments, same next step.
    eng = MegatronEngine(model_dir, role="actor", dims=ParallelDims(world).build(), lr=LR, seed=0)
    state = eng.state_dict()
    dcp.load(state, checkpoint_id=ckpt)
    eng.load_state_dict(state)
    out["restored_step"] = eng.global_step
    out["restored"] = {k: v.clone() for k, v in eng.export_weights()}
    eng.train_step(mine, loss_fn, mini_batch_size=N // 2, micro_batch_size=2)
    out["restored_second"] = {k: v.clone() for k, v in eng.export_weights()}
    del eng
    critic = MegatronEngine(model_dir, role="critic", dims=ParallelDims(world).build(), lr=LR, seed=1)
    state = critic.state_dict()
    dcp.load(state, checkpoint_id=ckpt + "_critic")
    critic.load_state_dict(state)
    out["critic_restored"] = {k: v.clone() for k, v in critic.export_weights()}
    out["critic_restored_values"] = critic.forward_no_grad(mine, micro_batch_size=3)["values"]
    del critic

    # bf16 compute (autocast over float32 weights) through the pipeline schedule.
    eng = MegatronEngine(model_dir, role="actor", dims=ParallelDims(world, pp=2).build(), lr=LR, seed=0,
                         param_dtype=torch.bfloat16)
    got = eng.forward_no_grad(mine, micro_batch_size=3)["logp"]
    out["bf16_logp_err"] = float((got - ref_logp)[mine["response_mask"].bool()].abs().max())
    out["bf16_metrics"] = eng.train_step(mine, loss_fn, mini_batch_size=N // 2, micro_batch_size=2)
    out["bf16"] = {k: v.clone() for k, v in eng.export_weights()}
    if rank == 0:
        torch.save(out, result)


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("megatron")
    spawn(_run, 2, str(tiny_model_dir), str(tmp / "ckpt"), str(tmp / "out.pt"))
    return torch.load(tmp / "out.pt")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logprobs_match_transformers(runs, layout):
    assert runs[f"{layout}_logp_err"] < 1e-5
    assert runs[f"{layout}_entropy_err"] < 1e-5


def test_data_parallel_coordinates(runs):
    assert runs["tp1_dp"] == [(2, 0), (2, 1)]
    assert runs["tp2_dp"] == [(1, 0), (1, 0)]  # one TP x PP group: a single replica
    assert runs["pp2_dp"] == [(1, 0), (1, 0)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_export_is_the_hf_folder(runs, layout):
    assert runs[f"{layout}_export_names"] == sorted(runs["fsdp"])  # no tied lm_head, as FSDP2
    assert runs[f"{layout}_export_err"] == 0.0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_grpo_update_equals_fsdp2(runs, layout):
    assert runs["fsdp_moved"] > 0.5 * LR  # the reference step moved the weights
    assert _max_diff(runs[layout], runs["fsdp"]) < 1e-5
    m, f = runs[f"{layout}_metrics"], runs["fsdp_metrics"]
    assert m.keys() == f.keys()
    for k in f:
        assert m[k] == pytest.approx(f[k], rel=1e-4, abs=1e-6), k


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_rollout_scores_like_the_actor_after_sync(runs, layout):
    assert runs[f"{layout}_sync_gap"] < 1e-4


def test_checkpoint_resumes_on_another_pipeline_layout(runs):
    assert runs["restored_step"] == 1
    assert _max_diff(runs["restored"], runs["pp2"]) == 0.0
    assert _max_diff(runs["pp2_second"], runs["pp2"]) > 0.5 * LR  # the second step moved the weights
    assert _max_diff(runs["restored_second"], runs["pp2_second"]) < 1e-5


def test_bf16_compute_keeps_float32_master_weights(runs):
    assert runs["bf16_logp_err"] < 0.1  # bf16 logits: ~3 significant digits
    assert runs["bf16_metrics"]["actor/grad_norm"] == pytest.approx(runs["fsdp_metrics"]["actor/grad_norm"],
                                                                    rel=0.05)
    assert all(v.dtype == torch.float32 for v in runs["bf16"].values())
    # Adam's first step is ~lr*sign(g): bf16 may flip the sign of tiny gradients, but only of a few.
    far = sum(int(((runs["bf16"][k] - v).abs() > LR / 2).sum()) for k, v in runs["fsdp"].items())
    assert far / sum(v.numel() for v in runs["fsdp"].values()) < 0.01


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_critic_values_and_update_equal_fsdp2(runs, layout):
    valid = make_batch(2048).select(slice(0, N // 2))["response_mask"].bool()  # rank 0's rows
    before, after = runs["fsdp_critic_values"], runs["fsdp_critic_after"]
    assert float((after - before)[valid].abs().max()) > 1e-3  # the reference update moved the values
    assert float((runs[f"{layout}_critic_values"] - before)[valid].abs().max()) < 1e-5
    assert float((runs[f"{layout}_critic_after"] - after)[valid].abs().max()) < 1e-5
    assert sorted(runs[f"{layout}_critic"]) == sorted(runs["fsdp_critic"])  # backbone + score, no lm_head
    assert "score.weight" in runs["fsdp_critic"]
    assert _max_diff(runs[f"{layout}_critic"], runs["fsdp_critic"]) < 1e-5
    m, f = runs[f"{layout}_critic_metrics"], runs["fsdp_critic_metrics"]
    assert m.keys() == f.keys() and {"critic/vf_loss", "critic/grad_norm", "critic/lr"} <= f.keys()
    # vf_clipfrac counts loss2 > loss1, which for an unclipped token compares old + (v - old) with v:
    # float rounding decides it on either engine, so it is not compared.
    for k in f.keys() - {"critic/vf_clipfrac"}:
        assert m[k] == pytest.approx(f[k], rel=1e-4, abs=1e-6), k


def test_critic_checkpoint_resumes_on_another_layout(runs):
    # Saved at pp=2 after its update, loaded at pp=1 (dp=2) by an engine whose own value head differs
    # (seed 1).
    assert _max_diff(runs["critic_restored"], runs["pp2_critic"]) == 0.0
    valid = make_batch(2048).select(slice(0, N // 2))["response_mask"].bool()
    assert float((runs["critic_restored_values"] - runs["pp2_critic_after"])[valid].abs().max()) < 1e-5
