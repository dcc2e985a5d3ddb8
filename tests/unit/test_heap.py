"""spmdrl.heap: with large frees returned, a step's freed activations leave the resident set (glibc)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmdrl import heap

REPO = Path(__file__).resolve().parents[2]
# 50 blocks of 8 MiB, each followed by a small live tensor that pins the heap above it, then the blocks
# freed: glibc's default (its threshold raised past 8 MiB by one freed block) keeps them in the heap.
SCRIPT = """
import sys, torch
from spmdrl import heap
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
    env["PYTHONPATH"] = str(REPO)
    kept = {mode: float(subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                                       check=True, env=env, timeout=120).stdout)
            for mode in ("off", "on")}
    assert kept["off"] > 300, kept  # glibc's default keeps most of the 400 MiB
    assert kept["on"] < 50, kept


def test_a_users_malloc_setting_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert heap.return_large_frees() is False
