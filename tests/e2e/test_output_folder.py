"""Every run's files survive (spmdrl/checkpoint/run_folder.py): a second run on a folder in use stops before
any model loads, naming the holder; a fresh start keeps the earlier run's files under previous/ and says so.
Resuming still appends to and trims metrics.jsonl exactly: tests/e2e/test_resume.py. The fresh start's
runs are in the shared 1-rank job (tests/e2e/shared_runs.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO, TINY, read_metrics, train
from shared_runs import declare

from spmdrl.checkpoint.run_folder import LOCK

pytestmark = pytest.mark.e2e

HOLD = ("import sys, time; from pathlib import Path; from spmdrl.checkpoint.run_folder import OutputLock; "
        "OutputLock.acquire(Path(sys.argv[1])); print('held', flush=True); time.sleep(300)")


def test_a_second_run_on_a_folder_in_use_stops_before_loading_naming_the_holder(tmp_path, spmdrl_cache):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        proc = train([*TINY, "--trainer.total_steps", "1", "--trainer.output_dir", str(out)],
                     cache=spmdrl_cache, nproc=2, check=False, timeout=180)
        took = time.monotonic() - start
        assert proc.returncode != 0
        assert "spmdrl.train: error: trainer.output_dir" in proc.stderr
        assert f"in use by another run (host {socket.gethostname()} pid {holder.pid}," in proc.stderr
        assert "[rank 0/2]" not in proc.stdout  # stopped before any model was built
        assert took < 120, took
        assert holder.poll() is None and (out / LOCK).exists()  # the first run keeps its folder and lock
    finally:
        holder.kill()
        holder.wait()


FRESH = [*TINY, "--trainer.total_steps", "1", "--rollout.n", "2"]
declare("output_folder/first", [*FRESH, "--trainer.output_dir", "{base}/output_folder/first"], nproc=1)
# The README command again, unchanged, on a copy of that folder: resume auto with no checkpoint is a fresh
# start too.
declare("output_folder/again", [*FRESH, "--trainer.output_dir", "{base}/output_folder/again",
                                "--trainer.resume", "auto"], nproc=1,
        copy=("{base}/output_folder/first", "{base}/output_folder/again"))


def test_a_fresh_start_keeps_the_earlier_runs_files_and_says_where(shared):
    first, out = shared.path("output_folder/first"), shared.path("output_folder/again")
    assert len(shared.rows("output_folder/first")) == 1 and not (first / LOCK).exists()  # released at exit
    first_metrics = (first / "metrics.jsonl").read_text()
    first_config = (first / "config.yaml").read_text()
    err = shared.stderr("output_folder/again")
    kept = list((out / "previous").iterdir())
    assert len(kept) == 1
    assert (kept[0] / "metrics.jsonl").read_text() == first_metrics  # byte for byte, not truncated
    assert (kept[0] / "config.yaml").read_text() == first_config
    assert f"the earlier run's files (config.yaml, metrics.jsonl) were moved to {kept[0]}" in err
    assert "took over" not in err  # the first run released its lock
    assert [row["step"] for row in read_metrics(out)] == [1]  # the new run's own metrics.jsonl
    assert "resume: auto" in (out / "config.yaml").read_text()
