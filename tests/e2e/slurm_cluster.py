"""A real Slurm cluster of two nodes on this machine, for the tests of the sbatch scripts and two-node runs.

Each node is a network namespace of its own (``ip netns``), the two joined by a veth pair, and every process
entering one gets the node's host name (a UTS namespace, ``unshare --uts``) and an ``/etc/hosts`` that names
both nodes (a private bind mount), as a cluster's DNS would. Every process of the tests runs inside one of
them: ``munged`` (its socket is a file, reachable from both), ``slurmctld`` and ``slurmd -N n1`` in the
first, ``slurmd -N n2`` in the second, and each client (``sbatch``, ``scontrol``, a hand-started
``launch/multinode.sh``). So no traffic leaves the namespaces, and the daemons' fixed ports cannot meet
another test's.

``SlurmCluster.start`` writes the ``slurm.conf`` and the munge key into a temporary folder and starts the
daemons as children of the test; ``stop`` cancels the jobs, stops the daemons by their ids, kills whatever
still runs in the namespaces (``ip netns pids``) and deletes the namespaces with the veth pair, whatever
happened before. ``unavailable()`` says why a machine cannot host it (not root, a program
missing, no network namespaces): the tests skip with that reason, unless ``SPMDRL_REQUIRE_SLURM=1`` (set by
``.ci/run``), where a skip would hide that they never ran, and they fail instead.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "srun", "sinfo", "ip",
            "nsenter", "unshare")
REQUIRE_ENV = "SPMDRL_REQUIRE_SLURM"


@dataclass(frozen=True)
class Node:
    name: str  # the Slurm node name and the host name inside its namespace
    ns: str  # the network namespace
    addr: str  # its address on the veth pair


def unavailable() -> str | None:
    """Why this machine cannot run the cluster (None when it can)."""
    if os.geteuid() != 0:
        return "the Slurm tests need root (network namespaces, slurmd)"
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"the Slurm tests need {', '.join(missing)} (apt-get install slurm-wlm munge iproute2)"
    probe = f"spmdrl-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"network namespaces are not available here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def slurm_conf(root: Path, nodes: Sequence[Node], cpus: int) -> str:
    """The cluster's slurm.conf: the lines a CPU test cluster needs (docs/launch.md quotes them)."""
    head = nodes[0]
    lines = [
        "ClusterName=spmdrl-test",
        f"SlurmctldHost={head.name}({head.addr})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge' / 'munge.socket'}",
        # No cgroups in a container: track a job's processes by their parents, bind no CPUs.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "ReturnToService=2",
        # The seconds between SIGTERM and SIGKILL at a cancel or preemption: the trainer's save fits.
        "KillWait=60",
        "MinJobAge=600",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool' / '%n'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd-%n.log'}",
    ]
    lines += [f"NodeName={n.name} NodeAddr={n.addr} CPUs={cpus} State=UNKNOWN" for n in nodes]
    lines.append(f"PartitionName=cpu Nodes={','.join(n.name for n in nodes)} Default=YES MaxTime=INFINITE "
                 "State=UP")
    return "\n".join(lines) + "\n"


class SlurmCluster:
    """Two Slurm nodes in two network namespaces; see the module's docstring."""

    def __init__(self, root: Path) -> None:
        self.root = root
        # Namespace names by this process's id: two test sessions on one machine never share one.
        self.nodes = tuple(Node(f"n{i}", f"spmdrl-{os.getpid()}-n{i}", f"10.77.0.{i}") for i in (1, 2))
        self.conf = root / "slurm.conf"
        self.hosts = root / "hosts"  # /etc/hosts inside the namespaces (a private bind mount)
        self.daemons: list[subprocess.Popen] = []  # running
        self.started: list[subprocess.Popen] = []  # every daemon ever started, for the tests' last check
        self._namespaces: list[str] = []

    # -- processes inside a node ------------------------------------------------------------------------
    def argv(self, node: Node, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``node``'s network namespace under its host name."""
        # nsenter, not `ip netns exec`: that one remounts /sys, and slurmd needs the host's cgroup mounts.
        return ["nsenter", f"--net=/run/netns/{node.ns}", "unshare", "--uts", "--mount", "sh", "-c",
                'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"', str(self.hosts),
                node.name, *argv]

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The clients' environment: this one, with the cluster's slurm.conf."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **(extra or {})}

    def run(self, node: Node, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
            timeout: float = 60, check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess:
        out = subprocess.run(self.argv(node, argv), env=self.env(env), capture_output=True, text=True,
                             timeout=timeout, cwd=cwd)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} on {node.name} exited {out.returncode}: {out.stderr}")
        return out

    def popen(self, node: Node, argv: Sequence[str], *, log: Path, env: Mapping[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen:
        with open(log, "w") as f:
            return subprocess.Popen(self.argv(node, argv), env=self.env(env), stdout=f,
                                    stderr=subprocess.STDOUT, cwd=cwd)

    # -- life cycle -------------------------------------------------------------------------------------
    def start(self, cpus: int = 2, timeout: float = 60) -> None:
        """Namespaces, munge, slurmctld and a slurmd per node; returns when both nodes are idle."""
        try:
            self._network()
            self._munge()
            self.conf.write_text(slurm_conf(self.root, self.nodes, cpus))
            for sub in ("state", "spool", *(f"spool/{n.name}" for n in self.nodes)):
                (self.root / sub).mkdir(exist_ok=True)
            head = self.nodes[0]
            self._daemon(head, ["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
            for node in self.nodes:
                self._daemon(node, ["slurmd", "-D", "-N", node.name, "-f", str(self.conf)],
                             f"slurmd-{node.name}")
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise

    def _network(self) -> None:
        a, b = self.nodes
        self.hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.name}\n" for n in self.nodes))
        for node in self.nodes:
            subprocess.run(["ip", "netns", "add", node.ns], check=True, capture_output=True)
            self._namespaces.append(node.ns)
        # Both ends are made inside the namespaces: no interface of the test ever exists outside them.
        subprocess.run(["ip", "link", "add", "name", "veth0", "netns", a.ns, "type", "veth", "peer", "name",
                        "veth0", "netns", b.ns], check=True, capture_output=True)
        for node in self.nodes:
            for cmd in (["addr", "add", f"{node.addr}/24", "dev", "veth0"], ["link", "set", "veth0", "up"],
                        ["link", "set", "lo", "up"]):
                subprocess.run(["ip", "-n", node.ns, *cmd], check=True, capture_output=True)

    def _munge(self) -> None:
        folder = self.root / "munge"
        folder.mkdir(mode=0o711)
        key = folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._daemon(self.nodes[0], ["munged", "-F", "--force", f"--socket={folder / 'munge.socket'}",
                                     f"--key-file={key}", f"--pid-file={folder / 'munged.pid'}",
                                     f"--seed-file={folder / 'munged.seed'}", f"--log-file={folder / 'log'}"],
                     "munged")
        deadline = time.monotonic() + 10
        while not (folder / "munge.socket").exists():
            if time.monotonic() > deadline or self.daemons[-1].poll() is not None:
                raise RuntimeError(f"munged did not start; see {self.root / 'munged.out'}")
            time.sleep(0.05)

    def _daemon(self, node: Node, argv: Sequence[str], name: str) -> None:
        self.daemons.append(self.popen(node, argv, log=self.root / f"{name}.out"))
        self.started.append(self.daemons[-1])

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            for proc in self.daemons:
                if proc.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited ({proc.args[-4:]}); see {self.root}/*.out")
            out = self.run(self.nodes[0], ["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            states = out.stdout
            if out.returncode == 0 and states.count("idle") == len(self.nodes):
                return
            time.sleep(0.3)
        raise RuntimeError(f"the Slurm nodes did not become idle in {timeout:.0f} s: {states!r}")

    def stop(self) -> None:
        """Cancel every job, stop every process this cluster started, remove the namespaces and files."""
        if self.conf.exists() and self.daemons:
            subprocess.run(self.argv(self.nodes[0], ["scancel", "--full", "--user", "root"]), env=self.env(),
                           capture_output=True, timeout=30)
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.daemons):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for ns in self._namespaces:
            self._kill_namespace(ns)
            # Deleting a namespace deletes the veth end in it, and with it the pair.
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._namespaces.clear()
        self.daemons.clear()

    def _kill_namespace(self, ns: str) -> None:
        """Kill what is left in a namespace (job steps, slurmstepd) by process id."""
        for _ in range(50):
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            pids = [int(p) for p in out.stdout.split()]
            if out.returncode != 0 or not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    # -- jobs -------------------------------------------------------------------------------------------
    def sbatch(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path) -> int:
        """Submit from the first node; returns the job id."""
        out = self.run(self.nodes[0], ["sbatch", "--parsable", *argv], env=env, cwd=cwd)
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, RestartCnt, ExitCode, ...)."""
        out = self.run(self.nodes[0], ["scontrol", "show", "job", "-o", str(job_id)])
        return dict(re.findall(r"(\w+)=(\S*)", out.stdout))

    def wait(self, job_id: int, states: Sequence[str] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                         "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"),
             timeout: float = 300) -> dict[str, str]:
        """Poll until the job is in one of ``states``; returns its fields."""
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} not in {states} after {timeout:.0f} s: {fields}")

    def trainers(self, node: Node) -> dict[int, int]:
        """The trainer processes running on ``node``: {local rank: process id}."""
        out = subprocess.run(["ip", "netns", "pids", node.ns], capture_output=True, text=True)
        found = {}
        for pid in map(int, out.stdout.split()):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:  # it ended meanwhile
                continue
            if b"spmdrl.train" in argv and b"torch.distributed.run" not in argv:
                env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
                found[int(env[b"LOCAL_RANK"])] = pid
        return found
