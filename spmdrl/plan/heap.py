"""The host heap under a CPU run: glibc's malloc, which decides how much freed memory the process keeps.

    heap.return_large_frees()   # at start-up on CPU: large blocks go back to the OS when freed
    heap.trim()                 # give the heap's free pages back now (trainer.exact_memory, each phase)

glibc serves an allocation from its heap unless it is at least the mmap threshold, and raises that
threshold (up to 32 MiB) each time it frees an mmapped block. After a step's first large activations are
freed, the next step's activations (a few MiB each) come from the heap, which keeps freed chunks as its
own, fragmented between live ones: on the 0.5B-shaped model that held about 1.4 GB beyond what was live at
the update's peak. A fixed threshold keeps such blocks in their own mappings, returned on free.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

# glibc's mallopt parameter number for the mmap threshold (malloc.h); setting it also stops the threshold
# from rising on its own.
_M_MMAP_THRESHOLD = -3
# Blocks of at least this size get their own mapping: an activation of the 0.5B-shaped model is tens of
# MiB, the tiny model's few KiB stay in the heap. Each mapping costs a page fault per 4 KiB on first touch.
MMAP_THRESHOLD = 4 << 20


@functools.lru_cache(maxsize=1)
def _libc() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator decides alone
        return None


def return_large_frees(threshold: int = MMAP_THRESHOLD) -> bool:
    """Blocks of at least ``threshold`` bytes in mappings of their own from now on (glibc); whether it was
    set. A user's ``MALLOC_MMAP_THRESHOLD_`` in the environment wins: glibc read it at start-up."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))


def trim() -> None:
    """Give the heap's free pages back to the OS (glibc ``malloc_trim``), so the resident set is what is
    live."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
