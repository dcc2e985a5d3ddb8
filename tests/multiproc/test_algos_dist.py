"""Batch-wide statistics over gloo ranks equal the single-process result on the concatenated batch.

Each rank holds whole prompt groups (rows split unevenly, with uneven token
counts), calls the estimators with ``group=WORLD``, and the concatenation of
the ranks' outputs must match one process on the full batch with ``group=None``.
"""

import pytest
import torch
import torch.distributed as dist
from dist_utils import spawn

pytestmark = pytest.mark.dist

WHITENED = ["gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg"]
ROWS, T, N_PER_PROMPT = 8, 5, 2


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 5, 3])  # uneven valid tokens per row
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()  # [B, T]
    mask[6, 2] = 0.0  # an observation token inside a response
    rewards = torch.zeros(ROWS, T)
    # Zero scores in rows 1-3 make GPG's alpha differ between the shards (8/5 over the whole batch).
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 0.5, 3.0, 1.0])
    rewards[torch.arange(ROWS), lengths - 1] = scores
    # Dense token rewards exercise the GAE chain; kept off the zero-score rows so they stay zero.
    rewards += 0.1 * torch.randn(ROWS, T, generator=g) * mask * (scores != 0).float().unsqueeze(1)
    return dict(
        rewards=rewards,
        mask=mask,
        index=torch.arange(ROWS) // N_PER_PROMPT,  # [B]
        values=torch.randn(ROWS, T, generator=g),
        logp=-torch.rand(ROWS, T, generator=g),
        ref_logp=-torch.rand(ROWS, T, generator=g),
        rollout_logp=-torch.rand(ROWS, T, generator=g),
    )


def _compute(b: dict[str, torch.Tensor], group) -> dict:
    from spmdrl.algos.kl import apply_kl_penalty
    from spmdrl.algos.registry import get_advantage
    from spmdrl.algos.utils import masked_mean, masked_var, masked_whiten

    out = {}
    for name in WHITENED:
        adv, ret = get_advantage(name)(
            b["rewards"], b["mask"], b["index"], values=b["values"], gamma=0.9, lam=0.8, group=group
        )
        out[name] = (adv, ret)
    x = b["values"]
    out["mean"] = masked_mean(x, b["mask"], group=group)
    out["var"] = masked_var(x, b["mask"], group=group)
    out["whiten"] = masked_whiten(x, b["mask"], group=group)
    _, metrics = apply_kl_penalty(
        b["rewards"], b["logp"], b["ref_logp"], b["mask"], kl_coef=0.1, kl_penalty="low_var_kl", group=group
    )
    out["batch_kl"] = metrics["actor/reward_kl_penalty"]
    from spmdrl.algos.rollout_correction import rollout_correction

    for level in ("token", "sequence"):  # every option on: weights, rejection, veto, batch normalisation
        out[f"corr_{level}"] = rollout_correction(
            b["logp"], b["rollout_logp"], b["mask"], rollout_is=level, rollout_is_threshold=1.5,
            rollout_is_batch_normalize=True, rollout_rs="geometric" if level == "sequence" else "token",
            rollout_rs_threshold=1.8, rollout_token_veto_threshold=0.3, group=group)
    return out


def _plain(obj):
    # Tensors put on the spawn queue are shared through file descriptors that
    # vanish when the rank exits, so results travel as nested Python lists.
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, (tuple, list)):
        return [_plain(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def _rank(rank: int, world_size: int, bounds: list[int]) -> dict:
    import spmdrl.algos  # noqa: F401

    rows = slice(bounds[rank], bounds[rank + 1])  # whole prompt groups only
    return _plain(_compute({k: v[rows] for k, v in _batch().items()}, dist.group.WORLD))


@pytest.mark.parametrize("bounds", [[0, 8], [0, 2, 8], [0, 4, 8]], ids=["1rank", "2ranks-2+6", "2ranks-4+4"])
def test_batch_statistics_match_one_process(bounds):
    import spmdrl.algos  # noqa: F401

    reference = _compute(_batch(), None)
    results = spawn(_rank, len(bounds) - 1, bounds)
    for name in WHITENED:
        for i in range(2):
            got = torch.cat([torch.tensor(r[name][i]).reshape(-1, T) for r in results])
            torch.testing.assert_close(got, reference[name][i], atol=1e-6, rtol=0, msg=f"{name} output {i}")
    for r in results:
        for key in ["mean", "var"]:
            assert r[key] == pytest.approx(reference[key].item(), abs=1e-6)
        assert r["batch_kl"] == pytest.approx(reference["batch_kl"], abs=1e-6)
    whitened = torch.cat([torch.tensor(r["whiten"]).reshape(-1, T) for r in results])
    torch.testing.assert_close(whitened, reference["whiten"], atol=1e-6, rtol=0)
    for level in ("token", "sequence"):  # rollout correction: weights, kept tokens and every diagnostic
        weights, kept, metrics = reference[f"corr_{level}"]
        for i, expected in ((0, weights), (1, kept)):
            got = torch.cat([torch.tensor(r[f"corr_{level}"][i]).reshape(-1, T) for r in results])
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=0, msg=f"correction {level} {i}")
        for r in results:
            assert r[f"corr_{level}"][2] == pytest.approx(metrics, abs=1e-6), level


def _grad_rank(rank: int, world_size: int) -> list:
    from spmdrl.algos.utils import masked_mean

    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True) * (rank + 1)
    x.retain_grad()
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]]) if rank == 0 else torch.ones(2, 2)
    masked_mean(x, mask, group=dist.group.WORLD).backward()
    return x.grad.tolist()


def test_masked_mean_gradient_flows_through_the_local_share():
    # global mean over 3 + 4 = 7 tokens: d mean / d x = mask / 7 on each rank
    g0, g1 = spawn(_grad_rank, 2)
    torch.testing.assert_close(torch.tensor(g0), torch.tensor([[1.0, 1.0], [1.0, 0.0]]) / 7)
    torch.testing.assert_close(torch.tensor(g1), torch.ones(2, 2) / 7)


def _uneven_micro_batches(rank: int, world_size: int) -> int:
    """Rank 0 measures the rollout gap of 3 micro-batches, rank 1 of 1, as under token budgets; then both
    meet in one all-reduce, which a collective inside the measurement would have paired wrongly."""
    import torch

    from spmdrl.objectives import rollout_gap_metrics

    g = torch.Generator().manual_seed(rank)
    for _ in range(3 if rank == 0 else 1):
        logp = -torch.rand(2, 4, generator=g)
        rollout_gap_metrics(logp, logp - 0.01, torch.ones(2, 4))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return int(t.item())


def test_rollout_gap_metrics_take_no_collective() -> None:
    assert spawn(_uneven_micro_batches, 2) == [3, 3]
