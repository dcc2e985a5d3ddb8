"""Split placement's meshes and weight hand-over on gloo ranks (spmdrl/parallel.py, spmdrl/split/).

- Roles come from the place in the world: the first ranks train (their own FSDP2 mesh), the last ones
  generate (their own rollout mesh), and the groups join exactly the ranks each exchange needs.
- Weights arrive bitwise: an FSDP2 actor sharded over the training ranks exports in the rollout dtype,
  training rank 0 sends them in flat buckets, and the rollout rank's native engine holds the very bits the
  actor exported.
"""

import pytest
import torch
from dist_utils import spawn
from rows import fsdp2_engine

pytestmark = pytest.mark.dist


def _roles(rank, world_size, rollout_ranks):
    import torch.distributed as dist

    from spmdrl.parallel import ParallelDims

    dims = ParallelDims(world_size, rollout_ranks=rollout_ranks).build()
    names = ("train", "train_cpu", "rollout", "weights",
             *(f"batch{r}" for r in range(world_size - rollout_ranks, world_size)))
    # The groups this rank is in (outside one, get_rank is -1), with their members.
    groups = {name: dist.get_process_group_ranks(dims.group(name)) for name in names
              if dist.get_rank(dims.group(name)) >= 0}
    mine = dims.train_mesh if dims.trains(rank) else dims.rollout_mesh
    return {"trains": dims.trains(rank), "generates": dims.generates(rank), "groups": groups,
            "mesh": mine.mesh.flatten().tolist(), "batch_world": dist.get_world_size(dims.batch_group)}


@pytest.mark.parametrize("world_size,rollout_ranks", [(2, 1), (3, 1), (3, 2)])
def test_split_meshes_give_each_rank_one_role(world_size, rollout_ranks):
    train = list(range(world_size - rollout_ranks))
    rollout = list(range(world_size - rollout_ranks, world_size))
    for rank, got in enumerate(spawn(_roles, world_size, rollout_ranks)):
        assert got["trains"] == (rank in train) and got["generates"] == (rank in rollout)
        assert got["mesh"] == (train if rank in train else rollout)
        # Batch-wide statistics reduce over the rank's own role.
        assert got["batch_world"] == (len(train) if rank in train else len(rollout))
        groups = {"train": train, "train_cpu": train, "rollout": rollout, "weights": [0, *rollout],
                  **{f"batch{r}": [*train, r] for r in rollout}}
        assert got["groups"] == {name: ranks for name, ranks in groups.items() if rank in ranks}


def _digest(t: torch.Tensor) -> tuple[str, str]:
    """dtype and sha256 of a tensor's bytes: bitwise equality without shipping the tensors back."""
    import hashlib

    return str(t.dtype), hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _weights(rank, world_size, model_dir):
    from spmdrl.parallel import ParallelDims
    from spmdrl.rollout.native.engine import NativeRollout
    from spmdrl.split.exchange import Exchange

    dims = ParallelDims(world_size, rollout_ranks=1).build()
    ex = Exchange(dims, rank, n=2, bucket_bytes=100_000)  # several buckets, some tensors larger than one
    if dims.trains(rank):
        actor = fsdp2_engine(model_dir, dims=dims, lr=1e-2, param_dtype=torch.bfloat16)
        # Move the weights off the folder's, so that only a real transfer can match them.
        with torch.no_grad():
            for i, p in enumerate(actor.model.parameters()):
                p.add_(0.01 * (i + 1))
        sent = {k: _digest(v) for k, v in actor.export_weights(torch.bfloat16)}
        ex.send_weights(actor.export_weights(torch.bfloat16))
        return sent
    engine = NativeRollout(model_dir, mesh=None, seed=0, eos_token_ids=[2], pad_token_id=0,
                           dtype=torch.bfloat16)
    received, validate = ex.recv_weights()
    assert validate is False
    engine.update_weights(iter(received))
    held = engine.model.weights.slots  # hf name -> its view in the engine's one buffer
    return {"received": {k: _digest(v) for k, v in received},
            "held": {k: _digest(held[k]) for k, _ in received},
            "dtypes": sorted({str(held[k].dtype) for k, _ in received})}


def test_weights_arrive_bitwise_in_the_rollout_dtype(tiny_model_dir):
    train0, _, rollout = spawn(_weights, 3, str(tiny_model_dir))
    assert rollout["dtypes"] == ["torch.bfloat16"]
    assert sorted(rollout["received"]) == sorted(train0)
    for name, digest in train0.items():
        assert digest[0] == "torch.bfloat16"
        assert rollout["received"][name] == digest and rollout["held"][name] == digest, name
