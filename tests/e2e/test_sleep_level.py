"""``rollout.sleep_level: 2`` frees the rollout weights between uses: every path that generates must
reload them first (DAPO's extra rounds, ReMax's greedy baseline, validation over several batches, and
the first step after validation)."""

import pytest
from conftest import TINY, read_metrics, train

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("config", ["dapo", "remax"])
def test_sleep_level_2_paths(config, tmp_path, spmdrl_cache):
    out = tmp_path / config
    # A reward that varies with the text, so DAPO keeps some groups of the random model's samples.
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return sum(map(ord, solution_str)) % 5 / 5\n")
    train(["--config", f"configs/{config}.yaml", *TINY, "--reward.function", f"{reward}:compute_score",
           "--trainer.total_steps", "2", "--rollout.n", "4", "--rollout.sleep_level", "2",
           "--trainer.test_freq", "1", "--trainer.val_before_train", "true",
           "--data.val_batch_size", "32", "--trainer.output_dir", str(out)], cache=spmdrl_cache, nproc=2)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(any(k.startswith("val-core/") for k in r) for r in rows)
    if config == "dapo":
        assert rows[-1]["dapo/num_gen_batches"] >= 1
