"""The fused log-prob head on 2 gloo ranks: the vocab-parallel kernel against the plain reference on the
whole vocabulary, and the FSDP2 engine (FSDP over 2 ranks, and TP=2) with the fused head against the same
engine computing the plain way, tied and untied: log-probs, entropies and one step's updated weights, so
FSDP2's reduce-scatter of the head's (and the tied embedding's) gradient is checked on this path. The
Megatron engine's untied head (tp=2, pp=2) against the plain FSDP2 path too.

One spawn runs every case; each rank returns plain floats.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import spawn
from plain_logprobs import plain_head, plain_token_outputs
from rows import pg_loss, rows_with_lengths

pytestmark = pytest.mark.dist

VOCAB, WIDTH = 11, 8  # 11 ids over 2 ranks: padded to 12 rows, rank 1's last row is padding
LR = 1e-4


def bonus_loss(outputs, mb, scale):
    mask = mb["response_mask"]
    loss = -((outputs["logp"] * mb["advantages"] + 0.1 * outputs["entropy"]) * mask).sum()
    return loss / scale.global_tokens, {"actor/pg_loss": loss.item()}


def _gap(x: torch.Tensor, y: torch.Tensor) -> float:
    """Largest |x - y| over y's scale (at least 1): gradients here reach ~40, where float32 rounding alone
    is 4e-6 a step."""
    return float((x - y).abs().max()) / max(1.0, float(y.abs().max()))


def _kernel_errors(rank: int, entropy_grad: bool) -> float:
    """Largest gap between the vocab-parallel kernel and the plain reference: outputs, hidden and head
    gradients (this rank's rows; its padding row's gradient must be 0)."""
    import torch.distributed as dist

    from spmdrl.engines.logprobs import token_outputs

    g = torch.Generator().manual_seed(7)  # the same tensors on both ranks
    weight = torch.randn(VOCAB, WIDTH, generator=g)
    hidden = 3 * torch.randn(3, 5, WIDTH, generator=g)
    labels = torch.randint(0, VOCAB, (3, 5), generator=g)
    a, b = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    rows = (VOCAB + 1) // 2
    shard = torch.cat([weight, torch.zeros(1, WIDTH)])[rank * rows : (rank + 1) * rows]  # [6, H]

    def run(fn, w):
        h, w = hidden.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = fn(h, w)
        loss = (out["logp"] * a).sum() + ((out["entropy"] * b).sum() if entropy_grad else 0)
        loss.backward()
        return out["logp"], out["entropy"], h.grad, w.grad

    want = run(lambda h, w: plain_token_outputs(h, w, labels, 0.7, True, entropy_grad), weight)
    got = run(lambda h, w: token_outputs(h, w, labels, 0.7, True, entropy_grad, tp_group=dist.group.WORLD,
                                         vocab=VOCAB), shard)
    mine = want[3][rank * rows : (rank + 1) * rows]  # this rank's real rows of the whole gradient
    errors = [_gap(x, y) for x, y in zip(got[:3], want[:3])] + [_gap(got[3][: len(mine)], mine)]
    return max(errors + [float(got[3][len(mine):].abs().max()) if len(mine) < rows else 0.0])


def _engine_run(cls, model_dir: str, dims, rank: int, world: int, loss) -> tuple:
    """forward_no_grad outputs on this rank's rows and the whole updated weights after one step of an
    FSDP2 or Megatron actor."""
    batch = rows_with_lengths([6, 2, 5, 3, 6, 1, 4, 2], [5, 3, 1, 4, 2, 5, 3, 4], 2048, seed=5)
    mine = batch.select(slice(rank * len(batch) // world, (rank + 1) * len(batch) // world))
    meshes = dict(dims=dims) if cls.strategy == "megatron" else dict(dp_mesh=dims.fsdp_mesh,
                                                                       tp_mesh=dims.tp_mesh)
    engine = cls(model_dir, role="actor", device="cpu", lr=LR, seed=0, temperature=0.7, **meshes)
    out = engine.forward_no_grad(mine, 2, with_entropy=True)
    engine.train_step(mine, loss, mini_batch_size=len(mine), micro_batch_size=2,
                      entropy_grad=loss is bonus_loss)
    return out, dict(engine.export_weights()), mine["response_mask"]


def _gaps(a: tuple, b: tuple) -> tuple[float, float]:
    """(largest output gap on valid tokens, largest weight gap) between two ``_engine_run`` results."""
    (out_a, w_a, mask), (out_b, w_b, _) = a, b
    return (max(float(((out_a[k] - out_b[k]) * mask).abs().max()) for k in out_b),
            max(float((w_a[k] - w_b[k]).abs().max()) for k in w_b))


def _run(rank: int, world: int, tied_dir: str, untied_dir: str) -> dict:
    from spmdrl.engines.fsdp2.engine import FSDP2Engine
    from spmdrl.engines.megatron.engine import MegatronEngine
    from spmdrl.parallel import ParallelDims

    out = {f"kernel_entropy_grad_{eg}": _kernel_errors(rank, eg) for eg in (False, True)}
    plain_untied = None
    for layout, dims in (("fsdp", ParallelDims(world).build()), ("tp", ParallelDims(world, tp=2).build())):
        for name, model_dir, loss in (("tied", tied_dir, pg_loss), ("untied", untied_dir, bonus_loss)):
            fused = _engine_run(FSDP2Engine, model_dir, dims, rank, world, loss)
            with plain_head():
                plain = _engine_run(FSDP2Engine, model_dir, dims, rank, world, loss)
            out[f"{layout}_{name}_outputs"], out[f"{layout}_{name}_weights"] = _gaps(fused, plain)
            plain_untied = plain if (layout, name) == ("fsdp", "untied") else plain_untied
    # Megatron's vocab-parallel head (tp=2) and an untied head on the last pipeline stage only (pp=2); its
    # tied head is test_megatron's.
    for layout in ("tp", "pp"):
        dims = ParallelDims(world, **{layout: 2}).build()
        megatron = _engine_run(MegatronEngine, untied_dir, dims, rank, world, bonus_loss)
        out[f"megatron_{layout}_outputs"], out[f"megatron_{layout}_weights"] = _gaps(megatron, plain_untied)
    return out


@pytest.fixture(scope="module")
def ranks(tiny_model_dir: Path, untied_model_dir: Path) -> list[dict]:
    return spawn(_run, 2, str(tiny_model_dir), str(untied_model_dir))


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_vocab_parallel_kernel_equals_the_plain_reference(ranks, entropy_grad):
    for r in ranks:
        assert r[f"kernel_entropy_grad_{entropy_grad}"] < 1e-5


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
@pytest.mark.parametrize("head", ["tied", "untied"])
def test_fsdp2_fused_head_equals_the_plain_path(ranks, layout, head):
    for r in ranks:
        assert r[f"{layout}_{head}_outputs"] < 1e-5
        assert r[f"{layout}_{head}_weights"] < 1e-5


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_megatron_untied_head_equals_the_plain_path(ranks, layout):
    for r in ranks:
        assert r[f"megatron_{layout}_outputs"] < 1e-5
        assert r[f"megatron_{layout}_weights"] < 1e-5
