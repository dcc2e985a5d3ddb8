"""The sandbox under attack: every probe of issue 22 (findings 2 and 4), built here and run in real workers.

A "python" tool executes the code it is given, as a tool that runs model-written Python would; each test
writes an attack as that code and asserts what the attack now gets at each sandbox level. The isolated
level is skipped only where this kernel refuses unprivileged namespaces.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import socket
import struct
import time
from pathlib import Path

import pytest

from spmdrl.agent.runner import _worker_setup
from spmdrl.agent.tools import ToolSpec
from spmdrl.reward.rule import RewardManager
from spmdrl.sandbox import confine
from spmdrl.sandbox.confine import Limits
from spmdrl.sandbox.frames import FrameError, FrameReader, encode
from spmdrl.sandbox.pool import WorkerPool

PYTHON_TOOL = '''
from spmdrl.agent.tools import Tool


class PythonTool(Tool):
    """Runs the model's code: what a code-interpreter tool does."""

    def execute(self, parameters, state):
        scope = {"state": state}
        exec(parameters["code"], scope)
        return str(scope.get("result", ""))
'''

ISOLATION = confine.isolation_problem()
LEVELS = ["process", pytest.param("isolated", marks=pytest.mark.skipif(
    bool(ISOLATION), reason=f"this kernel refuses unprivileged namespaces: {ISOLATION}"))]
needs_isolation = pytest.mark.skipif(bool(ISOLATION), reason=f"no unprivileged namespaces: {ISOLATION}")


def _pool(tmp_path: Path, level: str = "process", *, timeout_s: float = 5.0, workers: int = 1,
          **limits: int) -> WorkerPool:
    tool = tmp_path / "python_tool.py"
    tool.write_text(PYTHON_TOOL)
    schema = {"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}
    spec = ToolSpec(f"{tool}:PythonTool", {}, schema)
    return WorkerPool(_worker_setup, [[dataclasses.asdict(spec)]], num_workers=workers, timeout_s=timeout_s,
                      name="tool", start_timeout_s=60, limits=Limits(**{"memory_mb": 512, **limits}),
                      level=level)


def _call(code: str, state: dict | None = None) -> dict:
    return {"name": "python", "parameters": {"code": code}, "state": state or {}}


def _run(pool: WorkerPool, *codes: str):
    try:
        return pool.run([_call(c) for c in codes])
    finally:
        pool.close()


# ------------------------------------------------------------------ finding 2: replies are plain data


class _Gadget:
    """Unpickling this runs a shell command: the classic pickle payload."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_frames_are_json_only_and_capped():
    reader = FrameReader(max_bytes=100)
    assert reader.feed(encode({"id": 1, "ok": [1.5, {"a": None}]})[:5]) == [] and reader.partial
    gadget = pickle.dumps(_Gadget(Path("/nonexistent")))
    with pytest.raises(FrameError, match="not JSON"):
        FrameReader(10_000).feed(struct.pack(">I", len(gadget)) + gadget)
    with pytest.raises(FrameError, match="over the 100-byte limit"):
        FrameReader(100).feed(struct.pack(">I", 200 << 20))


@pytest.mark.parametrize("level", LEVELS)
def test_pickle_gadget_in_a_reply_runs_nothing_in_the_trainer(tmp_path, level):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Gadget(marker))
    frame = struct.pack(">I", len(payload)) + payload  # a well-framed pickle, as multiprocessing sends
    code = f"import os, sys\nos.write(int(sys.argv[1]), {frame!r})\nresult = 'sent'"
    out, after = _run(_pool(tmp_path, level), code, "result = 'fine'")
    assert "malformed reply" in out.error and out.value is None
    assert not marker.exists()
    assert after.value == ["fine", {}] and not after.error  # the worker was replaced


def test_partial_frame_kills_the_worker_at_its_deadline_and_scores_an_error(tmp_path):
    pid_file = tmp_path / "worker.pid"
    reward = tmp_path / "reward.py"
    reward.write_text(f'''
import os, struct, sys, time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    open({str(pid_file)!r}, "w").write(str(os.getpid()))
    os.write(int(sys.argv[1]), struct.pack(">I", 1000) + b'{{"id": 1, ')  # a frame that never ends
    time.sleep(600)
''')
    with RewardManager(f"{reward}:compute_score", num_workers=1, timeout_s=1.0) as rm:
        start = time.monotonic()
        out = rm(["x"], ["answer"], ["1"])
        elapsed = time.monotonic() - start
    assert out.scores.tolist() == [0.0] and out.num_errors == 1 and out.num_timeouts == 1
    assert "reply incomplete" in out.errors[0]
    assert elapsed < 4, elapsed  # the trainer did not wait on the half frame
    assert not Path(f"/proc/{pid_file.read_text()}").exists()  # killed and reaped


def test_forged_reply_ids_are_dropped(tmp_path):
    """One call writes replies for every id it can guess; the other call's result stays its own."""
    forge = ("import os, sys, struct, json\nfd = int(sys.argv[1])\nfor i in range(100):\n"
             "    body = json.dumps({'id': i, 'ok': ['FORGED', {}]}).encode()\n"
             "    os.write(fd, struct.pack('>I', len(body)) + body)\nresult = 'forger done'")
    pool = _pool(tmp_path, workers=2)
    try:
        slow, forger = pool.run([_call("import time; time.sleep(1.5); result = 'honest'"), _call(forge)])
        assert slow.value == ["honest", {}]
        assert pool.dropped >= 98  # every forged frame but (at most) the one that matched its own id
    finally:
        pool.close()


def test_state_must_be_plain_data_and_small(tmp_path):
    big = "state['blob'] = 'x' * (200 * 1024 * 1024); result = 'ok'"
    header = "import os, sys, struct\nos.write(int(sys.argv[1]), struct.pack('>I', 200 << 20))\nresult = 1"
    ok, too_big, raw, not_json = _run(_pool(tmp_path, memory_mb=1024), "state['n'] = 1; result = 'ok'", big,
                                      header, "state['f'] = open; result = 'ok'")
    assert ok.value == ["ok", {"n": 1}]
    assert too_big.value is None and ("limit of a worker's reply" in too_big.error
                                      or "MemoryError" in too_big.error)
    assert raw.value is None and "over the 16777216-byte limit" in raw.error
    assert not_json.value is None and "not plain data (JSON)" in not_json.error


# ------------------------------------------------------------------ finding 4: containment


@pytest.mark.parametrize("level", LEVELS)
def test_fork_bomb_and_every_descendant_die_at_the_timeout(tmp_path, level):
    """Children, grandchildren and a child that left the process group in its own session: all killed."""
    tag = f"bomb{os.getpid() % 100000}"
    code = f'''
import ctypes, os, time
def named():
    ctypes.CDLL(None).prctl(15, {tag.encode()!r}, 0, 0, 0)   # PR_SET_NAME: findable from outside
for i in range(20):
    try:
        if os.fork() == 0:
            named()
            if i % 5 == 0:
                os.setsid()
            if os.fork() == 0:
                named()
            time.sleep(600)
    except OSError:
        break
time.sleep(600)
'''
    start = time.monotonic()
    (out,) = _run(_pool(tmp_path, level, timeout_s=1.5), code)
    assert out.timed_out and time.monotonic() - start < 8
    left = [p for p in os.listdir("/proc") if p.isdigit() and _alive_named(p, tag)]
    assert left == []


def _alive_named(pid: str, name: str) -> bool:
    """Whether process ``pid`` is called ``name`` and is not a zombie (dead, waiting for init to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.index("(") + 1:stat.rindex(")")] == name and stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("level", LEVELS)
def test_children_left_behind_by_a_call_are_killed_after_it(tmp_path, level):
    code = ("import os, time\npids = []\nfor _ in range(10):\n    pid = os.fork()\n"
            "    if pid == 0:\n        time.sleep(600)\n    pids.append(pid)\nresult = len(pids)")
    pool = _pool(tmp_path, level)
    try:
        (out,) = pool.run([_call(code)])
        assert out.value[0] == "10"
        left = confine.descendants(pool.workers[0].proc.pid)
        assert len(left) == (2 if level == "isolated" else 0)  # isolated: the namespace's PID 1, the worker
    finally:
        pool.close()


def test_rlimit_nproc_caps_forks_for_an_ordinary_user(tmp_path):
    if os.getuid() == 0:
        pytest.skip("the kernel exempts uid 0 from RLIMIT_NPROC (at both levels); the timeout kill applies")
    code = ("import os, time\nn = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(60)\n    n += 1\n"
            "result = n")
    (out,) = _run(_pool(tmp_path, nproc=16), code)
    assert int(out.value[0]) <= 16


@pytest.mark.parametrize("level", LEVELS)
def test_memory_limit(tmp_path, level):
    (out,) = _run(_pool(tmp_path, level, memory_mb=512), "result = len(bytearray(2 << 30))")
    assert "MemoryError" in out.error


def test_reward_workers_have_a_memory_limit(tmp_path):
    reward = tmp_path / "hog.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return len(bytearray(16 << 30))\n")
    with RewardManager(f"{reward}:compute_score", num_workers=1, timeout_s=20) as rm:
        out = rm(["x"], ["a"], ["1"])
    assert out.num_errors == 1 and "MemoryError" in out.errors[0]


@pytest.mark.parametrize("level", LEVELS)
def test_output_flood_never_reaches_the_ranks_stdout(tmp_path, level, capfd):
    code = ("import os, sys\nchunk = b'x' * (1 << 20)\nn = 0\ntry:\n    for _ in range(100):\n"
            "        n += os.write(1, chunk)\n        n += os.write(2, chunk)\nexcept OSError as e:\n"
            "    err = str(e)\nprint('y' * 1000)\nresult = n")
    (out,) = _run(_pool(tmp_path, level, file_mb=8), code)
    captured = capfd.readouterr()
    assert len(captured.out) + len(captured.err) < 10_000
    assert out.error or int(out.value[0]) <= 8 << 20  # writes past RLIMIT_FSIZE (8 MiB) failed


@pytest.mark.parametrize("level", LEVELS)
def test_rlimit_fsize_caps_files(tmp_path, level):
    code = ("f = open('big', 'wb')\nn = 0\ntry:\n    for _ in range(100):\n"
            "        n += f.write(b'x' * (1 << 20)); f.flush()\nexcept OSError as e:\n    result = str(e)")
    (out,) = _run(_pool(tmp_path, level, file_mb=4), code)
    assert "File too large" in out.value[0]


@pytest.mark.parametrize("level", LEVELS)
def test_cpu_limit_ends_a_busy_call(tmp_path, level):
    (out,) = _run(_pool(tmp_path, level, timeout_s=30, cpu_s=1), "while True:\n    pass")
    assert "died" in out.error and not out.timed_out


@pytest.mark.parametrize("level", LEVELS)
def test_environment_has_no_secrets(tmp_path, level, monkeypatch):
    for key in ("SPMDRL_TEST_API_TOKEN", "AWS_SECRET_ACCESS_KEY", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID"):
        monkeypatch.setenv(key, "secret-value")
    code = "import json, os\nresult = json.dumps([dict(os.environ), os.getcwd()])"
    (out,) = _run(_pool(tmp_path, level), code)
    import json

    env, cwd = json.loads(out.value[0])
    assert "secret-value" not in out.value[0]
    assert set(env) <= set(confine.ENV_ALLOWLIST) | {"HOME", "TMPDIR", "PYTHONPATH",
                                                     "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED"}
    assert env["HOME"] == cwd and cwd.startswith(os.path.realpath(os.environ.get("TMPDIR", "/tmp")))


@pytest.fixture
def rendezvous():
    """A listening TCP socket standing in for the rendezvous store."""
    server = socket.create_server(("127.0.0.1", 0))
    yield server.getsockname()[1]
    server.close()


def _connect(port: int) -> str:
    return (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
            f"    result = 'connected'\nexcept OSError as e:\n    result = f'refused: {{e}}'")


def test_process_level_reaches_the_network(tmp_path, rendezvous):
    """What the README says the process level does not block."""
    (out,) = _run(_pool(tmp_path), _connect(rendezvous))
    assert out.value[0] == "connected"


@needs_isolation
def test_isolated_level_has_no_network(tmp_path, rendezvous):
    (out,) = _run(_pool(tmp_path, "isolated"), _connect(rendezvous))
    assert out.value[0].startswith("refused") and "unreachable" in out.value[0]


@pytest.mark.parametrize("level", LEVELS)
def test_file_writes_outside_the_work_dir(tmp_path, level):
    target = tmp_path / "outside.txt"
    code = (f"import os\nopen('inside.txt', 'w').write('ok')\n"
            f"try:\n    open({str(target)!r}, 'w').write('x')\n    result = 'wrote outside'\n"
            f"except OSError as e:\n    result = str(e)\n"
            f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"state['remount'] = libc.mount(None, b'/', None, 32 | 4096, None)")  # MS_REMOUNT|MS_BIND: rw
    (out,) = _run(_pool(tmp_path, level), code)
    assert out.value[1]["remount"] == -1  # no capabilities: it cannot undo read-only mounts
    if level == "isolated":
        assert "Read-only file system" in out.value[0] and not target.exists()
    else:
        assert out.value[0] == "wrote outside" and target.exists()


@pytest.mark.parametrize("level", LEVELS)
def test_signals_do_not_reach_the_rank(tmp_path, level):
    received = []
    old = signal.signal(signal.SIGUSR1, lambda *a: received.append(a))
    try:
        # To its process group: the worker's own session, not the rank's (the worker may well end itself).
        _run(_pool(tmp_path, level), "import os, signal\nos.kill(0, signal.SIGUSR1)\n"
                                     "os.killpg(os.getpgrp(), signal.SIGUSR1)")
        time.sleep(0.2)
        assert received == []
        by_pid = (f"import os, signal\ntry:\n    os.kill({os.getpid()}, signal.SIGUSR1)\n"
                  f"    result = 'sent'\nexcept OSError as e:\n    result = str(e)")
        (out,) = _run(_pool(tmp_path, level), by_pid)
        time.sleep(0.2)
        if level == "isolated":  # the rank has no PID in the worker's namespace
            assert "No such process" in out.value[0] and received == []
        else:  # same user, no namespace: a kill by PID is delivered (the README says so)
            assert out.value[0] == "sent" and len(received) == 1
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_isolated_level_is_refused_with_one_sentence_where_unavailable(monkeypatch):
    monkeypatch.setattr(confine, "isolation_problem", lambda: "unshare(user): Operation not permitted")
    msg = confine.probe_level("isolated")
    assert msg and msg.startswith("rollout.multi_turn.sandbox is 'isolated'") and "\n" not in msg
    assert confine.probe_level("process") is None


def test_a_worker_killed_while_idle_is_replaced_and_its_next_item_runs(tmp_path):
    pool = _pool(tmp_path)
    try:
        (first,) = pool.run([_call("result = 1")])
        os.kill(pool.workers[0].proc.pid, signal.SIGKILL)  # the OOM killer, between two batches
        pool.workers[0].proc.wait()
        (second,) = pool.run([_call("result = 2")])  # the write to the dead worker fails: retried
        assert first.value == ["1", {}] and second.value == ["2", {}] and not second.error
    finally:
        pool.close()


@pytest.mark.parametrize("level", LEVELS)
def test_the_ranks_proc_environ(tmp_path, level):
    """The rank's start-up environment through /proc: refused where the worker cannot ptrace-read the
    rank (a namespace, or a root rank with capabilities the worker gave up); readable by the same
    ordinary user at the process level (the README says so)."""
    code = (f"try:\n    result = str(len(open('/proc/{os.getpid()}/environ').read()))\n"
            f"except OSError as e:\n    result = str(e)")
    (out,) = _run(_pool(tmp_path, level), code)
    if level == "isolated" or os.getuid() == 0:
        assert "Permission denied" in out.value[0]
    else:
        assert out.value[0].isdigit()
