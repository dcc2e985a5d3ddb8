"""Mesh construction and validation on 1, 2 and 4 gloo processes."""

import pytest
import torch.distributed as dist
from dist_utils import spawn

from spmdrl.parallel import ParallelDims

pytestmark = pytest.mark.dist


def _meshes(rank, world_size, layouts):
    out = []
    for kw in layouts:
        dims = ParallelDims(world_size, **kw).build()
        tm, rm = dims.train_mesh, dims.rollout_mesh
        out.append(dict(
            train_shape=tuple(tm.shape),
            names=tm.mesh_dim_names,
            dp=dims.dp,
            dp_group=sorted(dist.get_process_group_ranks(tm.get_group("dp_shard"))),
            fsdp_ndim=dims.fsdp_mesh.ndim,
            tp_group=sorted(dist.get_process_group_ranks(tm.get_group("tp"))),
            rollout_tp_group=sorted(dist.get_process_group_ranks(rm.get_group("tp"))),
            rollout_dp_group=sorted(dist.get_process_group_ranks(rm.get_group("dp"))),
            coords=dims.coords(rank),
            mesh_coords=dict(zip(tm.mesh_dim_names, tm.get_coordinate())),
        ))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_default_layout_is_all_fsdp(world_size):
    results = spawn(_meshes, world_size, [dict()])
    for rank, (r,) in enumerate(results):
        assert r["train_shape"] == (1, 1, world_size, 1, 1)  # pp, dp_replicate, dp_shard, sp, tp
        assert r["names"] == ("pp", "dp_replicate", "dp_shard", "sp", "tp")
        assert r["dp"] == world_size and r["dp_group"] == list(range(world_size))
        assert r["rollout_tp_group"] == [rank]
        assert r["coords"]["dp_shard"] == rank and r["coords"]["rollout_dp"] == rank


def test_four_ranks_tp_hsdp_and_rollout_tp_blocks():
    layouts = [dict(tp=2, rollout_tp=2), dict(dp_replicate=2, dp_shard=2), dict(pp=2, tp=2, dp_shard=-1)]
    results = spawn(_meshes, 4, layouts)
    for rank, (tp2, hsdp, pp2) in enumerate(results):
        # TP groups and rollout TP groups are contiguous rank blocks.
        block = [rank - rank % 2, rank - rank % 2 + 1]
        assert tp2["train_shape"] == (1, 1, 2, 1, 2) and tp2["tp_group"] == block
        assert tp2["rollout_tp_group"] == block
        assert tp2["rollout_dp_group"] == [rank % 2, rank % 2 + 2]
        assert tp2["dp_group"] == [rank % 2, rank % 2 + 2]
        assert hsdp["train_shape"] == (1, 2, 2, 1, 1) and hsdp["fsdp_ndim"] == 2 and hsdp["dp"] == 4
        assert pp2["train_shape"] == (2, 1, 1, 1, 2) and pp2["dp"] == 1
        for r in (tp2, hsdp, pp2):
            # Our arithmetic coordinates agree with DeviceMesh's own.
            assert {k: r["coords"][k] for k in r["mesh_coords"]} == r["mesh_coords"]


@pytest.mark.parametrize(
    "world_size,kw,fragment",
    [
        (4, dict(tp=3), "world size 4 is not divisible by parallel.dp_replicate x tp x pp x sp = 3"),
        (4, dict(dp_shard=3), "= 3, but the world size is 4"),
        (2, dict(rollout_tp=4), "parallel.rollout_tp is 4, which does not divide the world size 2"),
        (2, dict(tp=0), "parallel.tp is 0; it must be an integer >= 1"),
        (2, dict(dp_shard=0), "parallel.dp_shard is 0"),
        (4, dict(ep=3), "parallel.ep is 3, which does not divide the 4 FSDP ranks"),
        (4, dict(ep=2, sp=2), "parallel.ep is 2 with parallel.sp=2; expert parallelism combines with plain"),
        (4, dict(ep=2, tp=2), "parallel.ep is 2 with parallel.tp=2"),
    ],
)
def test_invalid_degrees(world_size, kw, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        ParallelDims(world_size, **kw)
