"""spmdrl.plan.heap: with large frees returned, freed activations leave the resident set (glibc)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmdrl.plan import heap

REPO = Path(__file__).resolve().parents[2]
# 50 blocks of 8 MiB, each followed by a small live tensor that pins the heap above it, then the blocks
# freed: glibc's default (its threshold raised past 8 MiB by one freed block) keeps them in the heap.
# heap.py is loaded alone (it needs only ctypes), so that what other modules allocate at import time does not
# move glibc's threshold differently in the two runs.
SCRIPT = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("heap", sys.argv[2])
heap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heap)
if sys.argv[1] == "on":
    assert heap.return_large_frees()
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
base = rss_mb()
torch.ones(2 << 20).sum()
big, small = [], []
for _ in range(50):
    big.append(torch.ones(2 << 20))
    small.append(torch.ones(256))
del big
print(rss_mb() - base)
"""


@pytest.mark.skipif(heap._libc() is None, reason="not glibc: its allocator decides alone")
def test_freed_large_blocks_leave_the_resident_set():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    runs = {mode: subprocess.run([sys.executable, "-c", SCRIPT, mode, heap.__file__], capture_output=True,
                                 text=True, check=True, env=env, timeout=120) for mode in ("off", "on")}
    kept = {mode: float(run.stdout) for mode, run in runs.items()}
    assert kept["off"] > 300, kept  # glibc's default keeps most of the 400 MiB
    assert kept["on"] < 50, kept


def test_a_users_malloc_setting_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert heap.return_large_frees() is False
