"""One run at a time in an output folder, and no run's files lost to the next one.

    lock = OutputLock.acquire(out_dir)   # rank 0, before init_distributed; ConfigError names the holder
    ...
    lock.release()                       # at exit; a lock a dead process left behind is taken over
    set_aside_earlier_run(out_dir)       # rank 0 on a fresh start: an earlier run's files to previous/<time>/

The lock is ``{out_dir}/spmdrl.lock``: created with O_EXCL, holding the holder's host, pid, the pid's start
time (a reused pid has another) and the wall time it was taken, and kept under ``fcntl.flock`` for as long as
the holder lives, so the kernel drops it when the holder dies however it dies (SIGKILL, os._exit). A lock
file whose flock is free was left by a dead process: on its own host the pid check confirms that, and it is
taken over with one line saying so. A lock from another host whose flock is free is refused with the way
out (a file system may not share flock between hosts). Multi-node runs need a shared output folder anyway
(every rank writes its checkpoint shards there), so rank 0's lock covers the job.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Optional

from spmdrl.errors import ConfigError

log = logging.getLogger("spmdrl")

LOCK = "spmdrl.lock"
PREVIOUS = "previous"
# Everything a run writes into its output folder (hf: spmdrl.sft's export); a fresh start moves an earlier
# run's copies aside.
RUN_FILES = ("config.yaml", "metrics.jsonl", "plots", "tensorboard", "wandb", "checkpoints", "hf")


def _start_time(pid: int) -> Optional[str]:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat field 22); None when no such process
    is visible (or there is no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _holder_alive(holder: dict) -> bool:
    """Whether the process a lock file names (on this host) is still the one that wrote it."""
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    return _start_time(pid) is not None and _start_time(pid) == holder.get("pid_start")


class OutputLock:
    """This process's hold on an output folder (``acquire``; ``release`` at exit)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: Optional[int] = fd

    @classmethod
    def acquire(cls, out_dir: Path) -> "OutputLock":
        """The lock of ``out_dir``, or ConfigError naming the run that holds it and the way out."""
        path = out_dir / LOCK
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"trainer.output_dir {str(out_dir)!r} cannot be created ({err})") from err
        for _ in range(3):  # a holder releasing (unlinking) between our open and our flock: look again
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                fresh = True
            except FileExistsError:
                try:  # never through a link: the lock is rewritten in place
                    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
                except FileNotFoundError:
                    continue
                except OSError as err:
                    raise ConfigError(f"{str(path)!r} is not a lock file spmdrl can use ({err}); move it "
                                      f"away or choose another trainer.output_dir") from err
                fresh = False
            lock = cls._hold(path, fd, fresh)
            if lock is not None:
                return lock
        raise ConfigError(f"could not take the lock {str(path)!r}: it keeps changing hands; is another run "
                          f"starting in trainer.output_dir {str(out_dir)!r}?")

    @classmethod
    def _hold(cls, path: Path, fd: int, fresh: bool) -> Optional["OutputLock"]:
        """flock ``fd`` and write this process into it; None when ``path`` no longer names ``fd``'s file."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except OSError:
            locked = False
        holder = {} if fresh else _read_holder(fd)
        if not locked:
            os.close(fd)
            raise ConfigError(_busy(path, holder, "is still running"))
        try:
            same_file = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same_file = False
        if not same_file:
            os.close(fd)
            return None
        if not fresh:
            _take_over(path, fd, holder)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _start_time(os.getpid()),
              "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        return cls(path, fd)

    def release(self) -> None:
        """Remove the lock file (only while it is still ours) and drop the flock; idempotent."""
        if self._fd is None:
            return
        try:
            if os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)
        except OSError:
            pass  # gone already: nothing of ours to remove
        os.close(self._fd)
        self._fd = None


def _read_holder(fd: int) -> dict:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def _busy(path: Path, holder: dict, state: str) -> str:
    who = f"host {holder.get('host', '?')} pid {holder.get('pid', '?')}, since {holder.get('since', '?')}"
    return (f"trainer.output_dir {str(path.parent)!r} is in use by another run ({who}), which {state}; "
            f"give this run another trainer.output_dir or trainer.experiment_name, or stop that run")


def _take_over(path: Path, fd: int, holder: dict) -> None:
    """Take a lock file nobody holds, when it is safe to: its writer is known dead (this host) or unknown."""
    host = holder.get("host")
    if host is not None and host != socket.gethostname():
        os.close(fd)
        raise ConfigError(_busy(path, holder, "may still be running on that host (this machine cannot check)")
                          + f"; if it is not, delete {str(path)!r}")
    if host is not None and _holder_alive(holder):
        os.close(fd)  # alive but not holding the flock: a file system without flock; trust the pid
        raise ConfigError(_busy(path, holder, "is still running"))
    log.warning("took over the lock %s left by host %s pid %s (since %s), which is no longer running",
                path, host or "?", holder.get("pid", "?"), holder.get("since", "?"))


def set_aside_earlier_run(out_dir: Path, also: tuple[str, ...] = ()) -> Optional[Path]:
    """Move an earlier run's files (``RUN_FILES`` and the names in ``also``: trainer.rollout_data_dir) into
    ``{out_dir}/previous/<time>/`` and say so in one line; returns that folder, or None when there was
    nothing to keep. Renames only: nothing is copied or lost."""
    found = [out_dir / name for name in (*RUN_FILES, *also) if (out_dir / name).exists()]
    if not found:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = out_dir / PREVIOUS / stamp
    n = 1
    while dest.exists():
        n += 1
        dest = out_dir / PREVIOUS / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    for f in found:
        os.rename(f, dest / f.name)
    log.warning("fresh start in %s: the earlier run's files (%s) were moved to %s", out_dir,
                ", ".join(f.name for f in found), dest)
    return dest
