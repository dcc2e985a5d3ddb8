"""trainer.balance_batch on 2 gloo ranks: rank 0 generated the long answers and rank 1 the short ones.
Balancing must even out the tokens while each group (the n responses of a prompt) stays whole on one rank
and each global mini-batch keeps its rows, so one FSDP2 actor update with 2 mini-batches is the same with
and without it (float32: 1e-5). A critic whose mini-batch is half the actor's (PPO) keeps its update too
when the slots are ``balance_slot``'s; slots of the actor's mini-batch alone would change it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import spawn
from rows import fsdp2_engine, pg_loss, rows_with_lengths, vf_loss

pytestmark = pytest.mark.dist

N = 2  # responses per prompt
GROUPS = 4  # groups per rank; 2 mini-batch slots of 2 groups
LR = 1e-4


def _rank_batch(rank: int, vocab: int):
    """Rank 0: 12-25 attended tokens per row; rank 1: 3-6. Groups are consecutive rows sharing ``index``."""
    g = torch.Generator().manual_seed(10 + rank)
    rows = GROUPS * N
    (p_lo, p_hi), (r_lo, r_hi) = ((8, 13), (4, 13)) if rank == 0 else ((2, 4), (1, 3))
    batch = rows_with_lengths(torch.randint(p_lo, p_hi, (rows,), generator=g),
                              torch.randint(r_lo, r_hi, (rows,), generator=g), vocab, seed=10 + rank)
    batch["index"] = torch.arange(GROUPS).repeat_interleave(N) + rank * GROUPS  # [rows] global prompt ids
    return batch


def _run(rank: int, world: int, model_dir: str) -> dict:
    import torch.distributed as dist

    from spmdrl.engines.balance import balance_rows, balance_slot
    from spmdrl.parallel import ParallelDims

    dims = ParallelDims(world).build()
    mine = _rank_batch(rank, 2048)
    mini = len(mine) // 2
    balanced, metrics = balance_rows(mine, N, mini, dist.group.WORLD, torch.device("cpu"))
    out = {"metrics": metrics, "tokens": [int(b["attention_mask"].sum()) for b in (mine, balanced)],
           "index": balanced["index"].tolist(),
           "rows": [_row_keys(b) for b in (mine, balanced)]}
    critic_mini = mini // 2
    slot = balance_slot([mini, critic_mini])
    by_slot, _ = balance_rows(mine, N, slot, dist.group.WORLD, torch.device("cpu"))
    weights = {}
    for name, role, batch, loss, size in (("off", "actor", mine, pg_loss, mini),
                                          ("on", "actor", balanced, pg_loss, mini),
                                          ("critic_off", "critic", mine, vf_loss, critic_mini),
                                          ("critic_on", "critic", by_slot, vf_loss, critic_mini),
                                          ("critic_actor_slots", "critic", balanced, vf_loss, critic_mini)):
        eng = fsdp2_engine(model_dir, role, dims=dims, lr=LR)
        eng.train_step(batch, loss, mini_batch_size=size, micro_batch_size=2)
        weights[name] = {k: v.clone() for k, v in eng.export_weights()}
        del eng
    # Only small values go back through the queue (spawn's pipe would block on whole weight sets).
    off, on, start = weights["off"], weights["on"], _initial(model_dir)
    out["moved"] = max(float((off[k].float() - start[k].float()).abs().max()) for k in off if k in start)
    out["apart"] = _apart(off, on)
    out["critic_apart"] = _apart(weights["critic_off"], weights["critic_on"])
    out["critic_apart_actor_slots"] = _apart(weights["critic_off"], weights["critic_actor_slots"])
    return out


def _apart(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _initial(model_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{model_dir}/model.safetensors")


def _row_keys(batch) -> list[list[tuple[int, ...]]]:
    """Each mini-batch slot's rows as token tuples (what a row is, whatever its padding)."""
    mini = len(batch) // 2
    keys = []
    for part in batch.split(mini):
        ids, attn = part["input_ids"], part["attention_mask"].bool()
        keys.append([tuple(i[m].tolist()) for i, m in zip(ids, attn)])
    return keys


@pytest.fixture(scope="module")
def ranks(tiny_model_dir: Path) -> list[dict]:
    return spawn(_run, 2, str(tiny_model_dir))


def test_tokens_even_out(ranks):
    before = [r["tokens"][0] for r in ranks]
    after = [r["tokens"][1] for r in ranks]
    assert sum(before) == sum(after)
    assert max(after) - min(after) < (max(before) - min(before)) / 4, (before, after)
    m = ranks[0]["metrics"]
    assert m == ranks[1]["metrics"] and m["perf/balance_after"] < m["perf/balance_before"]


def test_groups_stay_whole_and_mini_batches_keep_their_rows(ranks):
    for r in ranks:
        idx = r["index"]
        assert all(idx[i] == idx[i + 1] for i in range(0, len(idx), N))
    everyone = sorted(ranks[0]["index"] + ranks[1]["index"])
    assert everyone == sorted(list(range(2 * GROUPS)) * N)
    for slot in (0, 1):
        off = sorted(ranks[0]["rows"][0][slot] + ranks[1]["rows"][0][slot])
        on = sorted(ranks[0]["rows"][1][slot] + ranks[1]["rows"][1][slot])
        assert off == on


def test_update_is_the_same_with_and_without_balancing(ranks):
    for r in ranks:
        assert r["moved"] > 1e-5 and r["apart"] < 1e-5, (r["moved"], r["apart"])


def test_a_critic_with_smaller_mini_batches_keeps_its_update(ranks):
    for r in ranks:
        assert r["critic_apart"] < 1e-5, r["critic_apart"]
        assert r["critic_apart_actor_slots"] > 1e-4, r["critic_apart_actor_slots"]  # what the slot prevents
