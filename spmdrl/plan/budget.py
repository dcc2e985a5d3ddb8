"""How much memory one rank may use, and what the process itself takes, read before any model exists.

    budget_bytes("cpu", local_ranks=2)   # the host's available memory (or its cgroup limit) / local ranks
    budget_bytes("cuda", local_ranks=8)  # one GPU's total memory per rank
    process_bytes()                      # this process's resident set now (torch and friends imported)

On CPU every rank of a node shares the host's memory, so each gets an equal share of what is available
when the run starts (MemAvailable, capped by a cgroup's memory.max); on a GPU each rank has its device,
read through NVML so that no CUDA context is made before the process group.
"""

from __future__ import annotations

from pathlib import Path


def _meminfo(key: str) -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return float(line.split()[1]) * 1024
    return float("nan")


def _cgroup_limit() -> float:
    """The cgroup v2 memory.max of this process, or inf."""
    try:
        value = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = float(Path("/sys/fs/cgroup/memory.current").read_text().strip())
    except (OSError, ValueError):
        return float("inf")
    return float("inf") if value == "max" else float(value) - used


def host_available() -> float:
    """Bytes of host memory available to this job now."""
    return min(_meminfo("MemAvailable"), _cgroup_limit())


def device_total(device_type: str) -> float:
    """Total bytes of one device: this rank's GPU (NVML), or the host's available memory."""
    if device_type != "cuda":
        return host_available()
    import os

    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("LOCAL_RANK", "0")))
    return float(pynvml.nvmlDeviceGetMemoryInfo(handle).total)


def budget_bytes(device_type: str, local_ranks: int) -> float:
    """What one rank may hold: its GPU, or its share of the host."""
    total = device_total(device_type)
    return total if device_type == "cuda" else total / max(1, local_ranks)


def process_bytes() -> float:
    """This process's resident set now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return float(line.split()[1]) * 1024
    return 0.0
