"""What a worker process does to itself before it runs user code, and the environment it starts with.

Two levels (``rollout.multi_turn.sandbox``):

- ``process``: the worker is its own session and process group (the trainer kills the whole group at a
  timeout), starts in a fresh temporary directory with an environment built from ``ENV_ALLOWLIST`` (no
  credentials, no rendezvous address), writes stdout/stderr to a file there, runs under
  ``RLIMIT_AS``, ``RLIMIT_NPROC``, ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` and ``RLIMIT_CORE=0``, and holds no
  capabilities (a trainer run as root does not hand root's powers to tools).
- ``isolated``: the same, inside new user, mount, network and PID namespaces (``unshare(2)``, unprivileged):
  no network interface but a down loopback, every mount read-only except the work directory, and the
  trainer's processes out of reach (they have no PID in the worker's namespace). The worker runs under
  the namespace's PID 1, so every process a tool starts dies with it.

    env = worker_env(workdir)                 # trainer side: the environment of a new worker
    problem = isolation_problem()             # trainer side: "" where this kernel allows ``isolated``
    isolate(workdir)                          # worker side, first thing
    apply_limits(limits, isolated)            # worker side, before importing user code
    drop_capabilities()                       # worker side, last
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

LEVELS = ("process", "isolated")

# Variables a worker inherits; everything else (tokens, cloud credentials, MASTER_ADDR, TORCHELASTIC_*,
# the rendezvous store) is dropped. HOME and TMPDIR point into the work directory.
ENV_ALLOWLIST = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONHASHSEED")

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
# Flags the kernel locks on mounts inherited from a more privileged namespace: a read-only remount must
# repeat them.
_KEPT_FLAGS = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048,
               "relatime": 1 << 21}
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 24, 36, 38
_CAP_LAST = 63  # past the kernel's last capability, PR_CAPBSET_DROP fails with EINVAL: harmless
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


@dataclass
class Limits:
    """Resource limits of one worker; each descendant inherits them."""

    memory_mb: int = 1024  # RLIMIT_AS of each process
    nproc: int = 32  # processes and threads a worker may add (RLIMIT_NPROC over what its user already runs)
    file_mb: int = 64  # RLIMIT_FSIZE: largest file it may write, its captured stdout/stderr included
    # RLIMIT_CPU of each call, on top of the worker's CPU time before it; None: the pool makes it
    # max(60, 4 x its timeout), a backstop the wall clock beats unless a call keeps over four cores busy
    cpu_s: Optional[int] = None


def worker_env(workdir: str) -> dict[str, str]:
    """The environment of a worker: the allowlisted variables, HOME and TMPDIR in ``workdir``, and a
    PYTHONPATH that imports what this process imports (spmdrl, the user's modules)."""
    env = {k: v for k, v in os.environ.items() if k in ENV_ALLOWLIST}
    env.setdefault("PATH", os.defpath)
    env.update(HOME=workdir, TMPDIR=workdir, PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(os.path.abspath(p) for p in sys.path if p))
    return env


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _user_tasks() -> int:
    """Processes and threads of this user, as RLIMIT_NPROC counts them (approximately: /proc owners)."""
    uid, n = os.getuid(), 0
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:  # exited while we looked
            pass
    return n


def apply_limits(limits: Limits, isolated: bool) -> None:
    """Set this process's limits (its children inherit them). In a new user namespace RLIMIT_NPROC counts
    that namespace's processes only; outside one it counts every process of the user, so the limit is
    what already runs plus ``nproc``. Processes with CAP_SYS_RESOURCE (root outside a user namespace) are
    exempt from RLIMIT_NPROC."""
    mb = 1024 * 1024
    nproc = limits.nproc if isolated else _user_tasks() + limits.nproc
    for res, value in ((resource.RLIMIT_AS, limits.memory_mb * mb), (resource.RLIMIT_NPROC, nproc),
                       (resource.RLIMIT_FSIZE, limits.file_mb * mb), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))
    # Writes past RLIMIT_FSIZE fail with EFBIG instead of killing the worker with SIGXFSZ.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def limit_cpu(limits: Limits) -> None:
    """Allow the next call ``cpu_s`` seconds of CPU (SIGXCPU past it); a backstop for the wall clock,
    which also bounds each child the call forks."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    soft = int(used.ru_utime + used.ru_stime) + (limits.cpu_s or 60)
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard),
                                             hard))


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the trainer that started it exits."""
    parent = os.getppid()
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the trainer died before the request took effect
        os._exit(1)


def drop_capabilities() -> None:
    """Give up every capability for good: this process and what it executes keep its uid but not root's
    powers, so a worker run by root is held by RLIMIT_NPROC, and a worker that is root of its own user
    namespace cannot undo the read-only mounts. Without capabilities (an ordinary user) it changes
    nothing."""
    libc = _libc()
    for cap in range(_CAP_LAST + 1):  # the bounding set: execve cannot grant them back, even to uid 0
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable (two words each): none
    _check(libc.capset(header, data), "dropping capabilities")
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "setting no_new_privs")


def _remount_read_only(workdir: str) -> None:
    """Every mount read-only except ``workdir`` (made its own mount first), in this mount namespace."""
    libc = _libc()
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "making mounts private")
    _check(libc.mount(workdir.encode(), workdir.encode(), None, _MS_BIND | _MS_REC, None),
           f"bind-mounting {workdir}")
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        point = fields[4].replace("\\040", " ")
        if point == workdir or point.startswith(workdir + "/"):
            continue
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
        for opt in fields[5].split(","):
            flags |= _KEPT_FLAGS.get(opt, 0)
        _check(libc.mount(None, point.encode(), None, flags, None), f"remounting {point} read-only")
    os.chdir(workdir)  # the old working directory is the read-only one underneath the new mount


def _fork_and_wait() -> None:
    """Fork; the child returns, the parent waits for it (reaping the orphans it inherits meanwhile) and
    exits with its status (128 + the signal that killed it)."""
    child = os.fork()
    if child == 0:
        return
    while True:
        pid, status = os.wait()
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)


def isolate(workdir: str) -> None:
    """Move into new user, mount, network and PID namespaces, make the file system read-only outside
    ``workdir``, and fork twice: the caller returns as PID 2 of the new namespace, under a PID 1 that only
    reaps (the kernel shields a namespace's PID 1 from signals it does not handle, SIGXCPU included, so
    the worker must not be it) and whose exit kills every process in the namespace. The original process
    waits too, so the trainer still sees and kills the PID it started, and its group."""
    uid, gid = os.getuid(), os.getgid()
    _check(_libc().unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID),
           "unshare(user, mount, network, pid)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    _remount_read_only(workdir)
    _fork_and_wait()
    die_with_parent()
    _fork_and_wait()


def descendants(root: int) -> list[int]:
    """PIDs of every living (not zombie) descendant of ``root`` (by parent links in /proc), nearest
    first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):  # exited while we looked
            continue
        if state != "Z":  # a zombie is dead already; its parent reaps it
            children.setdefault(int(ppid), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def kill_tree(root: int, *, including_root: bool) -> None:
    """SIGKILL every descendant of ``root`` (then ``root``). Workers are child subreapers, so a process
    whose parent dies (a double fork, one that started its own session) is re-parented to the worker and
    found on the next round, until none is left."""
    for _ in range(20):
        pids = descendants(root)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    if including_root:
        try:
            os.kill(root, signal.SIGKILL)
        except ProcessLookupError:
            pass


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process instead of init, so it can find them."""
    _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def kill_strays(isolated: bool) -> None:
    """SIGKILL what the last call left running, and reap it: in the namespace, every process but this one
    and PID 1 (which reaps the orphans); otherwise every descendant of this worker (a subreaper: the
    orphans are its children)."""
    if isolated:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:  # nothing else runs
            pass
    else:
        kill_tree(os.getpid(), including_root=False)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


@functools.lru_cache(maxsize=None)
def isolation_problem() -> str:
    """Why ``isolated`` cannot run here ("" when it can): the namespaces are tried in a child process."""
    with tempfile.TemporaryDirectory(prefix="spmdrl-probe-") as tmp:
        code = "import sys; from spmdrl.sandbox.confine import isolate; isolate(sys.argv[1])"
        try:
            proc = subprocess.run([sys.executable, "-c", code, os.path.realpath(tmp)], capture_output=True,
                                  text=True, timeout=30, env=worker_env(tmp))
        except (OSError, subprocess.TimeoutExpired) as err:
            return str(err)
    lines = proc.stderr.strip().splitlines()
    return "" if proc.returncode == 0 else (lines[-1] if lines else f"exit code {proc.returncode}")


def probe_level(level: str) -> Optional[str]:
    """A one-sentence refusal of sandbox ``level`` on this machine, or None when it can run."""
    if level == "isolated" and isolation_problem():
        return (f"rollout.multi_turn.sandbox is 'isolated' but this kernel refuses unprivileged namespaces "
                f"({isolation_problem()}); use 'process' or allow user namespaces")
    return None
