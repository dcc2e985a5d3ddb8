"""The hang watchdog end to end: two ranks under torchrun, one of them stalled by a user reward function
that never returns; the job must end non-zero within seconds of trainer.hang_timeout_s, every rank's
Python stacks in its log, and one sentence naming the stalled rank and phase."""

from __future__ import annotations

import re
import time

import pytest
from conftest import TINY, train

from spmdrl.checkpoint.run_folder import LOCK, OutputLock
from spmdrl.checkpoint.watchdog import HANG_EXIT_CODE

pytestmark = pytest.mark.e2e

HANG_S = 10
# A legitimate extension point, no test hook in the product: a reward function that stalls on rank 1 only.
STALLING_REWARD = """
import os, time
from pathlib import Path

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if os.environ["RANK"] == "1":
        Path(os.environ["STALL_MARK"]).write_text(str(time.time()))
        time.sleep(600)
    return 0.0
"""


def test_a_stalled_rank_ends_the_job_with_every_ranks_stacks(tmp_path, spmdrl_cache, caplog):
    reward = tmp_path / "stall.py"
    reward.write_text(STALLING_REWARD)
    mark = tmp_path / "stalled_at"
    proc = train([*TINY, "--trainer.total_steps", "3", "--rollout.n", "2",
                  "--reward.function", f"{reward}:compute_score", "--trainer.hang_timeout_s", str(HANG_S),
                  "--trainer.output_dir", str(tmp_path / "run")],
                 cache=spmdrl_cache, nproc=2, check=False, env={"STALL_MARK": str(mark)}, timeout=300)
    ended = time.time()
    log = proc.stdout + proc.stderr
    (tmp_path / "hang.log").write_text(log)
    assert proc.returncode != 0
    # The deadline, the firing rank's grace (its peer's deadline falls inside it) and torchrun's teardown.
    assert ended - float(mark.read_text()) < HANG_S + HANG_S + 20, log[-3000:]
    assert re.search(rf"rank 1 made no progress in phase reward for {HANG_S}\d? s", log)
    assert f"then it exits with code {HANG_EXIT_CODE}" in log
    assert "rank 0 made no progress in phase" in log  # rank 0, waiting in a collective, fired as well
    # faulthandler's dumps: rank 1's stack shows the reward function, rank 0's the collective it waits in.
    assert log.count("Current thread 0x") == 2 and log.count("(most recent call first)") >= 4
    assert "in compute_score" in log and "spmdrl/loop.py" in log
    # os._exit(3) skips every finally: the lock file stays, but its flock died with rank 0, so the next run
    # on this folder takes it over and says so.
    assert (tmp_path / "run" / LOCK).exists()
    OutputLock.acquire(tmp_path / "run").release()
    assert "which is no longer running" in caplog.text



def test_a_stalled_rollout_rank_is_named_by_its_role_under_split_placement(tmp_path, spmdrl_cache):
    # Split placement, 1 training + 1 rollout rank: the reward runs on the rollout rank (rank 1) only.
    reward = tmp_path / "stall.py"
    reward.write_text(STALLING_REWARD)
    proc = train([*TINY, "--trainer.total_steps", "3", "--rollout.n", "2", "--trainer.val_before_train",
                  "false", "--trainer.test_freq", "-1", "--rollout.placement", "split",
                  "--rollout.n_gpus_per_node", "1",
                  "--reward.function", f"{reward}:compute_score", "--trainer.hang_timeout_s", str(HANG_S),
                  "--trainer.output_dir", str(tmp_path / "run")],
                 cache=spmdrl_cache, nproc=2, check=False, env={"STALL_MARK": str(tmp_path / "mark")},
                 timeout=300)
    log = proc.stdout + proc.stderr
    (tmp_path / "hang.log").write_text(log)
    assert proc.returncode != 0
    assert re.search(rf"rank 1 \(rollout rank\) made no progress in phase reward for {HANG_S}\d? s", log)
    # The training rank waits for the batch: its own watchdog names its role and that wait.
    assert "rank 0 (training rank) made no progress in phase wait_rollout" in log
    assert "in compute_score" in log and "spmdrl/split/rollout_role.py" in log
