"""The output folder's lock (one run at a time, stale locks taken over) and a fresh start that keeps an
earlier run's files (spmdrl/checkpoint/run_folder.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from spmdrl.checkpoint.run_folder import LOCK, OutputLock, _start_time, set_aside_earlier_run
from spmdrl.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
HOLD = ("import sys, time; from pathlib import Path; from spmdrl.checkpoint.run_folder import OutputLock; "
        "OutputLock.acquire(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)")


@pytest.fixture
def holder(tmp_path: Path):
    """Another process holding the lock of ``tmp_path / 'out'``, as a running training job's rank 0 does."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "out")], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def _write_lock(out: Path, **holder) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK).write_text(json.dumps({"since": "earlier", **holder}))


def test_a_second_run_on_a_held_folder_is_refused_naming_host_and_pid(tmp_path, holder):
    with pytest.raises(ConfigError) as err:
        OutputLock.acquire(tmp_path / "out")
    msg = str(err.value)
    assert f"host {socket.gethostname()} pid {holder.pid}" in msg
    assert "trainer.output_dir" in msg and "\n" not in msg
    assert holder.poll() is None  # the holder is untouched and still owns its lock
    assert json.loads((tmp_path / "out" / LOCK).read_text())["pid"] == holder.pid


def test_the_lock_of_a_killed_holder_is_taken_over_and_said(tmp_path, holder, caplog):
    holder.kill()  # SIGKILL: no release; the lock file stays, the kernel drops the flock
    holder.wait()
    assert (tmp_path / "out" / LOCK).exists()
    lock = OutputLock.acquire(tmp_path / "out")
    assert f"pid {holder.pid}" in caplog.text and "no longer running" in caplog.text
    assert json.loads((tmp_path / "out" / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / "out" / LOCK).exists()


def test_a_reused_pid_does_not_keep_a_stale_lock(tmp_path, caplog):
    # This very pid is alive, but it started at another time than the lock's writer: a reused pid.
    _write_lock(tmp_path, host=socket.gethostname(), pid=os.getpid(), pid_start="1")
    OutputLock.acquire(tmp_path).release()
    assert "no longer running" in caplog.text


def test_a_live_pid_that_holds_no_flock_is_still_refused(tmp_path):
    # A file system without flock: the lock file and the pid check are all there is.
    _write_lock(tmp_path, host=socket.gethostname(), pid=os.getpid(), pid_start=_start_time(os.getpid()))
    with pytest.raises(ConfigError, match=f"pid {os.getpid()}"):
        OutputLock.acquire(tmp_path)
    assert (tmp_path / LOCK).exists()


def test_a_lock_from_another_host_is_refused_with_the_way_out(tmp_path):
    _write_lock(tmp_path, host="node-7-elsewhere", pid=4242, pid_start="99")
    with pytest.raises(ConfigError, match="host node-7-elsewhere pid 4242.*delete") as err:
        OutputLock.acquire(tmp_path)
    assert str(tmp_path / LOCK) in str(err.value)


def test_a_planted_link_is_not_followed_and_an_impossible_folder_is_one_sentence(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("the user's data")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / LOCK).symlink_to(victim)
    with pytest.raises(ConfigError, match="is not a lock file spmdrl can use"):
        OutputLock.acquire(tmp_path / "out")
    assert victim.read_text() == "the user's data"
    with pytest.raises(ConfigError, match="cannot be created"):  # a file where a folder must go
        OutputLock.acquire(victim / "out")


def test_release_frees_the_folder_for_the_next_run(tmp_path, caplog):
    lock = OutputLock.acquire(tmp_path)
    lock.release()
    lock.release()  # idempotent: exit paths may both call it
    OutputLock.acquire(tmp_path).release()
    assert "took over" not in caplog.text


def test_a_fresh_start_moves_the_earlier_runs_files_aside_unchanged(tmp_path, caplog):
    rows = '{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.75}\n'
    (tmp_path / "metrics.jsonl").write_text(rows)
    (tmp_path / "config.yaml").write_text("trainer: {}\n")
    (tmp_path / "checkpoints" / "global_step_2").mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("the user's own file")
    dest = set_aside_earlier_run(tmp_path)
    assert dest.parent == tmp_path / "previous"
    assert (dest / "metrics.jsonl").read_text() == rows
    assert (dest / "config.yaml").read_text() == "trainer: {}\n"
    assert (dest / "checkpoints" / "global_step_2").is_dir()
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
    assert (tmp_path / "notes.txt").read_text() == "the user's own file"  # not a run's file: left alone
    assert str(dest) in caplog.text and "metrics.jsonl" in caplog.text
    # A second fresh start in the same second gets its own folder; an empty folder has nothing to keep.
    (tmp_path / "metrics.jsonl").write_text(rows)
    assert set_aside_earlier_run(tmp_path) != dest
    assert set_aside_earlier_run(tmp_path) is None
