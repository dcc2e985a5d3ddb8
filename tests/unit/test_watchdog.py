"""The hang watchdog (spmdrl/checkpoint/watchdog.py): a rank stuck in one phase dumps every thread's stack and
exits with code 3; heartbeats keep it quiet; 0 turns it off. The two-rank run is tests/e2e/test_hang.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from spmdrl.checkpoint.watchdog import COLLECTIVE_TIMEOUT_S, HANG_EXIT_CODE, Watchdog, collective_timeout_s

REPO = Path(__file__).resolve().parents[2]


def _run(code: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    return proc, time.monotonic() - start


def test_a_stalled_phase_dumps_every_thread_and_exits_3_soon_after_the_deadline():
    proc, took = _run(
        "import threading, time\n"
        "from spmdrl.checkpoint.watchdog import Watchdog\n"
        "threading.Thread(target=lambda: time.sleep(60), name='busy-helper', daemon=True).start()\n"
        "w = Watchdog(1.0, rank=5)\n"
        "w.beat('rollout'); time.sleep(0.5); w.beat('reward')\n"
        "def score_forever(): time.sleep(60)\n"
        "score_forever()\n")
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr
    assert took < 15
    assert "rank 5 made no progress in phase reward for 1 s" in proc.stderr
    # faulthandler's dump: the stuck main thread's frame and the other thread's too.
    assert proc.stderr.count("Thread 0x") == 2  # main and busy-helper; the watchdog is the "Current thread"
    assert "in score_forever" in proc.stderr and "Current thread 0x" in proc.stderr


def test_heartbeats_and_close_keep_it_quiet_and_zero_turns_it_off():
    proc, _ = _run(
        "import time\n"
        "from spmdrl.checkpoint.watchdog import Watchdog\n"
        "w = Watchdog(1.0, rank=0)\n"
        "for _ in range(8): w.beat('update'); time.sleep(0.3)\n"  # 2.4 s in all, never 1 s without a beat
        "w.close(); time.sleep(1.5)\n"
        "off = Watchdog(0, rank=0); off.beat('rollout'); assert off._thread is None\n"
        "print('finished')\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "finished" and "no progress" not in proc.stderr


def test_the_collective_timeout_outlasts_the_watchdog_and_never_drops_below_the_default():
    assert collective_timeout_s(None) == collective_timeout_s(0) == COLLECTIVE_TIMEOUT_S
    assert collective_timeout_s(5) == COLLECTIVE_TIMEOUT_S  # a short watchdog leaves model loading alone
    assert collective_timeout_s(1800) > 1800 + Watchdog(1800, 0, world_size=2).grace_s
    assert collective_timeout_s(7200) > 7200
