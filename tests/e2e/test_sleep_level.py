"""``rollout.sleep_level: 2`` frees the rollout weights between uses: every path that generates must
reload them first (DAPO's extra rounds, ReMax's greedy baseline, validation over several batches, and
the first step after validation). The runs are in the shared jobs (tests/e2e/shared_runs.py)."""

import pytest
from conftest import TINY
from shared_runs import declare, prepare

pytestmark = pytest.mark.e2e


@prepare
def _reward(base) -> None:
    # A reward that varies with the text, so DAPO keeps some groups of the random model's samples.
    (base / "sleep_level").mkdir(exist_ok=True)
    (base / "sleep_level" / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return sum(map(ord, solution_str)) % 5 / 5\n")


for _config in ("dapo", "remax"):
    declare(f"sleep_level/{_config}", [
        "--config", f"configs/{_config}.yaml", *TINY, "--reward.function",
        "{base}/sleep_level/reward.py:compute_score", "--trainer.total_steps", "2", "--rollout.n", "4",
        "--rollout.sleep_level", "2", "--trainer.test_freq", "1", "--trainer.val_before_train", "true",
        "--data.val_batch_size", "32", "--trainer.output_dir", f"{{base}}/sleep_level/{_config}"])


@pytest.mark.parametrize("config", ["dapo", "remax"])
def test_sleep_level_2_paths(config, shared):
    rows = shared.rows(f"sleep_level/{config}")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(any(k.startswith("val-core/") for k in r) for r in rows)
    if config == "dapo":
        assert rows[-1]["dapo/num_gen_batches"] >= 1
