"""export_weights -> native rollout engine: after a sync the engine scores tokens exactly as the actor
does."""

import pytest
import torch
from dist_utils import spawn
from rows import fsdp2_engine

pytestmark = pytest.mark.dist


def _sync(rank, world_size, model_dir):
    from torch.distributed.device_mesh import init_device_mesh

    from spmdrl.batch import from_generation
    from spmdrl.rollout.base import SamplingParams
    from spmdrl.rollout.native.engine import NativeRollout

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    actor = fsdp2_engine(model_dir, dp_mesh=mesh, lr=1e-2)
    engine = NativeRollout(model_dir, mesh=None, seed=rank, eos_token_ids=[2], pad_token_id=0)
    prompts = [[1, 100 + rank, 200, 300], [1, 50, 60]]
    sampling = SamplingParams(n=2, max_tokens=8, temperature=1.0)

    def logp_gap():
        gen = engine.generate(prompts, sampling)
        batch = from_generation(gen, torch.arange(len(prompts)))
        actor_logp = actor.forward_no_grad(batch, micro_batch_size=8)["logp"]  # [N, R]
        mask = batch["response_mask"].bool()
        return (actor_logp - gen.logprobs)[mask].abs().max().item(), batch

    before, batch = logp_gap()
    # One real optimizer step moves the actor away from the folder's weights.
    batch["advantages"] = torch.randn(batch["response_mask"].shape,
                                      generator=torch.Generator().manual_seed(0))

    def loss_fn(outputs, mb, scale):
        loss = -(outputs["logp"] * mb["advantages"] * mb["response_mask"]).sum() / scale.global_tokens
        return loss, {}

    actor.train_step(batch, loss_fn, mini_batch_size=len(batch), micro_batch_size=len(batch))
    stale, _ = logp_gap()
    engine.sleep(2)
    engine.wake_up(("weights",))
    engine.update_weights(actor.export_weights())
    engine.wake_up(("kv_cache",))
    after, _ = logp_gap()

    # bf16 compute: export in bf16 gathers whole FSDP units (one collective each) and must equal
    # the per-parameter gather of the float32 master cast to bf16, name for name, bit for bit.
    bf16 = fsdp2_engine(model_dir, dp_mesh=mesh, lr=1e-2, param_dtype=torch.bfloat16)
    bf16.train_step(batch, loss_fn, mini_batch_size=len(batch), micro_batch_size=len(batch))
    by_unit = list(bf16.export_weights(torch.bfloat16))
    by_param = {k: v.to(torch.bfloat16) for k, v in bf16.export_weights()}
    same = sorted(k for k, _ in by_unit) == sorted(by_param) and all(
        v.dtype == torch.bfloat16 and torch.equal(v, by_param[k]) for k, v in by_unit)
    return before, stale, after, same


def test_export_weights_round_trip(tiny_model_dir):
    for before, stale, after, same in spawn(_sync, 2, str(tiny_model_dir)):
        assert before < 1e-4  # same folder, same numbers
        assert stale > 1e-3  # the update changed the actor, the engine is behind
        assert after < 1e-4  # after the sync they agree again
        assert same
