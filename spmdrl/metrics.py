"""Phase timers, per-phase peak memory, and the metric sinks of rank 0.

    timer = PhaseTimer(device, on_phase=watchdog.beat)   # on_phase: told each phase's name as it starts
    with timer.phase("rollout"): ...
    metrics.update(timer.pop())     # timing/rollout, memory/rollout_peak_gb, ..., timing/step, timing/other

Every second of a step is in a named phase: ``pop`` closes the step's window (from the previous ``pop``)
into ``timing/step`` and reports what no phase covered as ``timing/other``. A phase opened inside
another is reported as ``timing/<outer>/<inner>`` (multi-turn ``rollout/tools``) and counted once, in its
outer phase.

Peak memory per phase: on CUDA ``torch.cuda.max_memory_allocated`` (reset at
phase start) plus NVML's device-wide figure when pynvml is importable; on CPU
the process's peak resident set (VmHWM), reset at phase start through
``/proc/self/clear_refs``. glibc keeps most freed memory in the heap, so on CPU a phase's peak is the
process's high-water mark so far unless ``exact_memory`` (``trainer.exact_memory``) trims the heap at
each phase start: then it is what the phase itself holds (live memory at its start plus its own
temporaries), the figure the memory plan predicts, at some cost in time.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from spmdrl.checkpoint.layout import replace_atomically
from spmdrl.parallel import gather_bytes
from spmdrl.plan import heap

GB = 1024**3


def _rss_peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PhaseTimer:
    """Wall time and peak memory of each named phase of a step."""

    def __init__(self, device: torch.device, on_phase: Optional[Callable[[str], None]] = None,
                 exact_memory: bool = False) -> None:
        self.device = device
        self.on_phase = on_phase  # the hang watchdog's heartbeat (spmdrl/checkpoint/watchdog.py)
        self.exact_memory = exact_memory  # CPU: trim the heap at each phase start (trainer.exact_memory)
        self._metrics: dict[str, float] = {}
        self._overall_peak = 0.0
        self._open: list[str] = []  # the phases running now, outermost first
        self._covered = 0.0  # seconds of the window inside outermost phases
        self._window = time.perf_counter()

    def restart(self) -> None:
        """Start a fresh window and forget what was timed so far (before the first step)."""
        self._metrics, self._covered, self._window = {}, 0.0, time.perf_counter()

    def _reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            if self.exact_memory:
                heap.trim()
            _reset_rss_peak()

    def _peak_gb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / GB
        return _rss_peak_bytes() / GB

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.on_phase is not None:
            self.on_phase(name)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        outer = not self._open
        name = "/".join([*self._open, name])
        self._open.append(name.rsplit("/", 1)[-1])
        if outer:  # a nested phase's peak is its outer phase's too: resetting it would lose that
            self._reset_peak()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - start
            self._open.pop()
            self._metrics[f"timing/{name}"] = self._metrics.get(f"timing/{name}", 0.0) + seconds
            self._covered += seconds if outer else 0.0
            peak = self._peak_gb()
            key = f"memory/{name}_peak_gb"
            self._metrics[key] = max(self._metrics.get(key, 0.0), peak)
            self._overall_peak = max(self._overall_peak, peak)
            if self.device.type == "cuda":
                self._metrics[f"memory/{name}_nvml_gb"] = _nvml_used_gb(self.device)

    def pop(self) -> dict[str, float]:
        """Metrics since the last pop, the window's ``timing/step`` and ``timing/other`` (the seconds of it
        that no phase covered), and the run's overall peak so far; a new window starts."""
        now = time.perf_counter()
        out, self._metrics = self._metrics, {}
        out["timing/step"] = now - self._window
        out["timing/other"] = max(0.0, out["timing/step"] - self._covered)
        out["memory/overall_peak_gb"] = self._overall_peak
        self._covered, self._window = 0.0, now
        return out


def _nvml_used_gb(device: torch.device) -> float:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        return pynvml.nvmlDeviceGetMemoryInfo(handle).used / GB
    except Exception:  # NVML absent or unsupported: the torch figure stands alone
        return float("nan")


# Counts over the batch: summed over ranks (each rank counts its own rows), so that one rank and k ranks log
# the same number. Every other key is a mean over rows (equal on every rank: the batch's placement gives
# each as many), a max or a min, or a batch-wide figure already reduced where it was computed.
COUNTS = frozenset({"batch/responses", "dapo/kept_groups", "dapo/dropped_groups", "reward/num_errors",
                    "reward/num_timeouts"})


def reduce_metrics(metrics: dict[str, float], group: dist.ProcessGroup) -> dict[str, float]:
    """Each key over the ranks of ``group`` that report it: counts (``COUNTS``) summed, ``*/max`` keys the
    max, ``*/min`` the min, memory and timing keys the max (the slowest / largest rank matters), the rest the
    mean.

    Ranks may report different keys (a scorer's extras depend on the data
    source a rank happened to get), so the key set is agreed first: a
    collective over mismatched tensors would hang.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(metrics)
    all_keys = [json.loads(b) for b in gather_bytes(json.dumps(sorted(metrics)).encode(), group)]
    keys = sorted({k for ks in all_keys for k in ks})
    present = torch.tensor([k in metrics for k in keys], dtype=torch.float64)
    vals = torch.tensor([float(metrics.get(k, 0.0)) for k in keys], dtype=torch.float64)
    is_max = torch.tensor([k.endswith("/max") or k.startswith(("memory/", "timing/")) for k in keys])
    is_min = torch.tensor([k.endswith("/min") for k in keys])
    is_count = torch.tensor([k in COUNTS for k in keys])
    summed, count = vals * present, present.clone()
    maxed = torch.where(present.bool(), vals, torch.full_like(vals, -math.inf))
    mined = torch.where(present.bool(), vals, torch.full_like(vals, math.inf))
    dist.all_reduce(summed, group=group)
    dist.all_reduce(count, group=group)
    dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(mined, op=dist.ReduceOp.MIN, group=group)
    mean_or_sum = torch.where(is_count, summed, summed / count)
    out = torch.where(is_max, maxed, torch.where(is_min, mined, mean_or_sum))
    return dict(zip(keys, out.tolist()))


def _wandb_mode() -> str:
    """WANDB_MODE when set; else online with an API key (WANDB_API_KEY or ~/.netrc), offline without one.

    Rank 0 under torchrun has no terminal on which wandb could ask for a key; without this, wandb.init
    stops a run that only lacks a key.
    """
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return "online" if netrc.netrc().authenticators(host) else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


def trim_metrics(path: Path, last_step: int) -> None:
    """Drop metric rows after ``last_step`` (they will be logged again) and a half-written last line."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line)["step"]) <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    replace_atomically(path, "".join(f"{line}\n" for line in kept))


class MetricsSink:
    """Rank 0 writes metrics: a console line, metrics.jsonl, tqdm, and wandb/tensorboard when chosen.

    ``initial_step`` is the step the run starts after (a resumed checkpoint's; 0 on a fresh start): on a
    resume, rows of metrics.jsonl after it are dropped first. A fresh start never drops a row: the loop has
    moved an earlier run's metrics.jsonl aside by then (``checkpoint.run_folder.set_aside_earlier_run``).
    """

    CONSOLE_KEYS = (
        ("reward/mean", "reward", "{:.3f}"),
        ("response_length/mean", "len", "{:.1f}"),
        ("actor/pg_loss", "pg", "{:+.4f}"),
        ("actor/kl_loss", "kl", "{:.4f}"),
        ("actor/entropy", "ent", "{:.3f}"),
        ("actor/grad_norm", "gnorm", "{:.3f}"),
        ("train/loss", "loss", "{:.4f}"),  # spmdrl.sft
        ("val/loss", "val_loss", "{:.4f}"),
        ("train/grad_norm", "gnorm", "{:.3f}"),
        ("perf/tokens_per_s", "tok/s", "{:.0f}"),
        ("timing/step", "s", "{:.2f}"),
    )

    def __init__(
        self,
        out_dir: Path,
        loggers: list[str],
        total_steps: int,
        *,
        rank: int,
        progress_bar: bool = True,
        project: str = "spmdrl",
        experiment: str = "run",
        config: Optional[dict] = None,
        initial_step: int = 0,
        name: str = "train",
    ) -> None:
        """``name``: what the progress bar says it runs (the algorithm, or sft)."""
        self.rank = rank
        self.loggers = loggers
        self._jsonl = None
        self._bar = None
        self._wandb = None
        self._tb = None
        if rank != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        if initial_step > 0:  # no checkpoint is ever taken at step 0: 0 is a fresh start
            trim_metrics(out_dir / "metrics.jsonl", initial_step)
        if "jsonl" in loggers:
            self._jsonl = open(out_dir / "metrics.jsonl", "a")
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, desc=name, dynamic_ncols=True,
                             file=sys.stderr)
        if "wandb" in loggers:
            import wandb

            mode = _wandb_mode()
            if mode == "offline":
                print(f"spmdrl: wandb logs offline under {out_dir / 'wandb'} (WANDB_MODE, or no API key); "
                      f"upload with: wandb sync {out_dir / 'wandb'}/offline-run-*", file=sys.stderr,
                      flush=True)
            self._wandb = wandb.init(project=project, name=experiment, config=config, dir=str(out_dir),
                                     mode=mode)
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed run logs its steps after initial_step again: drop the events a killed run left there,
            # as metrics.jsonl drops its rows.
            self._tb = SummaryWriter(str(out_dir / "tensorboard"),
                                     purge_step=initial_step + 1 if initial_step else None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.rank != 0:
            return
        row = {"step": step, **{k: float(v) for k, v in sorted(metrics.items())}}
        if self._jsonl:
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if "console" in self.loggers:
            parts = [f"step {step}"]
            parts += [f"{label} {fmt.format(metrics[k])}"
                      for k, label, fmt in self.CONSOLE_KEYS if k in metrics]
            line = " | ".join(parts)
            if self._bar is not None:
                self._bar.write(line)
            else:
                print(line, flush=True)
        if self._bar is not None:
            self._bar.update(1)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()  # each step on disk now, not every 120 s: a crashed run keeps its curves

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()
