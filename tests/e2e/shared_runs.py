"""Short trainings that tests read after the fact, run together: one torchrun job per rank count instead of
one job per training (a job's start costs ~10 s of imports and rendezvous on 2 cores; the runs are a few
seconds each).

A test module declares its runs when it is imported, and its tests take the session's ``shared`` fixture
(tests/e2e/conftest.py), whose first use runs every declared run:

    declare("split/colocated", [*ARGS, "--trainer.output_dir", "{base}/split/colocated"], nproc=1)
    ...
    def test_x(shared):
        rows = shared.rows("split/colocated")  # its metrics.jsonl (the run's error, if it had one)
        assert "resumed from" in shared.stdout("split/resumed")

``{base}`` in an argument is the session's folder of shared runs; ``@prepare`` functions write inputs (a
parquet file) there first. Runs go through ``matrix_driver.py`` in declaration order, the jobs in rank-count
order (a run may resume from a run of fewer or as many ranks declared before it), each run with its own
environment variables on top of the job's (``env``), its own stdout/stderr files and its own compiled
kernels, as if it ran alone.
What needs a process of its own stays out: a run killed or restarted by torchrun, a hang, a launcher flag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from torchrun import REPO, torchrun

DRIVER = REPO / "tests" / "e2e" / "matrix_driver.py"


@dataclass
class Declared:
    name: str
    argv: list[str]  # "{base}" stands for the session's folder of shared runs
    nproc: int
    env: dict[str, str] = field(default_factory=dict)
    stale: bool = False  # stale_driver.py's scripted stale run instead of spmdrl.train's (one rank)
    copy: tuple[str, str] | None = None  # (src, dst): a folder to copy before the run ("{base}" too)
    job_env: dict[str, str] = field(default_factory=dict)  # read at process start: a job of their own
    sft: bool = False  # spmdrl.sft's run, not spmdrl.train's
    late: bool = False  # after the job's other runs


DECLARED: dict[str, Declared] = {}
PREPARE: list[Callable[[Path], None]] = []


def declare(name: str, argv: list[str], *, nproc: int = 2, env: dict[str, str] | None = None,
            stale: bool = False, copy: tuple[str, str] | None = None,
            job_env: dict[str, str] | None = None, sft: bool = False, late: bool = False) -> str:
    """Add a run (``spmdrl.train``'s arguments) to the shared jobs; returns ``name``. ``stale``: the
    scripted stale run of ``stale_driver.py`` on those arguments instead, its rows read by ``scripted``.
    ``copy``: (src, dst) folders: dst becomes a copy of src (an earlier run's) before this run, so that a
    resume in dst leaves what src's run left for its tests. ``job_env``: variables the process reads when it
    starts (the ISA caps of test_isa_hidden.py): the runs with the same ones share a job of their own.
    ``sft``: ``spmdrl.sft``'s arguments, not ``spmdrl.train``'s. ``late``: run after the job's other runs
    (a Megatron run leaves Megatron's global process groups behind, which the runs before it never see; a
    run that could hang ends the job with no other run still to come)."""
    if name in DECLARED:
        raise ValueError(f"shared run {name!r} is declared twice")
    if stale and nproc != 1:
        raise ValueError(f"shared run {name!r}: the scripted stale run takes one rank")
    DECLARED[name] = Declared(name, list(argv), nproc, env=dict(env or {}), stale=stale, copy=copy,
                              job_env=dict(job_env or {}), sft=sft, late=late)
    return name


def file_name(name: str) -> str:
    """A run's name as the driver and its log files have it (no folder separators)."""
    return name.replace("/", "--")


def prepare(fn: Callable[[Path], None]) -> Callable[[Path], None]:
    """Decorator: ``fn(base)`` writes a run's inputs under ``base`` before any job starts."""
    PREPARE.append(fn)
    return fn


class SharedRuns:
    """The shared runs' results: each run's status, metrics and output, by name."""

    def __init__(self, base: Path, results: dict[str, dict]) -> None:
        self.base, self.results = base, results

    def path(self, relative: str) -> Path:
        return self.base / relative

    def ran(self, name: str) -> None:
        """Fail the calling test with the run's error when it did not finish."""
        got = self.results.get(name, {"status": "not run", "message": "not declared"})
        assert got["status"] == "ran", f"shared run {name}: {got['status']}: {got.get('message', '')}\n" \
            f"{got.get('traceback', '')}"

    def refused(self, name: str) -> str:
        """The sentence a run was refused with (fails the calling test when it was not)."""
        got = self.results.get(name, {"status": "not run", "message": "not declared"})
        assert got["status"] == "refused", f"shared run {name}: {got['status']}, not refused: {got}"
        return got["message"]

    def rows(self, name: str, out: str | None = None) -> list[dict]:
        """The run's metrics.jsonl rows (``out``: its output folder under base, when not ``name``)."""
        self.ran(name)
        text = (self.base / (out or name) / "metrics.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def scripted(self, name: str) -> list[dict]:
        """A ``stale`` run's rows, one per step."""
        self.ran(name)
        return json.loads((self.base / "logs" / f"{file_name(name)}.json").read_text())

    def _logs(self, name: str, stream: str) -> str:
        self.ran(name)
        files = sorted((self.base / "logs").glob(f"{file_name(name)}.rank*.{stream}"))
        return "".join(f.read_text() for f in files)

    def stdout(self, name: str) -> str:
        """Every rank's stdout of the run, rank by rank."""
        return self._logs(name, "stdout")

    def stderr(self, name: str) -> str:
        return self._logs(name, "stderr")


def run_all(base: Path, cache: str) -> SharedRuns:
    """Every declared run, one torchrun job per rank count (and ``job_env``), fewest ranks first."""
    logs = base / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for fn in PREPARE:
        fn(base)
    results: dict[str, dict] = {}
    jobs: dict[tuple, list[Declared]] = {}
    for d in DECLARED.values():
        jobs.setdefault((d.nproc, tuple(sorted(d.job_env.items()))), []).append(d)
    for k, ((nproc, job_env), declared) in enumerate(sorted(jobs.items(), key=lambda job: job[0][0])):
        declared = sorted(declared, key=lambda d: d.late)  # stable: declaration order otherwise
        cases = []
        for d in declared:
            case = {"name": file_name(d.name), "env": d.env, "logs": str(logs), "fresh": True,
                    "argv": [a.replace("{base}", str(base)) for a in d.argv]}
            if d.stale:
                case["stale"] = str(logs / f"{case['name']}.json")
            if d.copy:
                case["copy"] = [c.replace("{base}", str(base)) for c in d.copy]
            if d.sft:
                case["sft"] = True
            cases.append(case)
        cases_file, results_file = base / f"cases{k}.json", base / f"results{k}.json"
        cases_file.write_text(json.dumps(cases, indent=1))
        proc = torchrun([str(DRIVER), str(cases_file), str(results_file)], nproc=nproc,
                        env={"SPMDRL_CACHE": cache, **dict(job_env)}, timeout=1500, check=False)
        (base / f"job{k}.log").write_text(proc.stdout + proc.stderr)
        got = json.loads(results_file.read_text()) if results_file.exists() else {}
        for d, case in zip(declared, cases):
            results[d.name] = got.get(case["name"], {
                "status": "not run", "message": f"the {nproc}-rank shared job ended (exit {proc.returncode}) "
                                                f"before it:\n{proc.stderr[-3000:]}"})
    return SharedRuns(base, results)
