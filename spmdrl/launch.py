"""Turn a launch environment into the ``torchrun`` command that starts spmdrl.

Three ways to start the same SPMD program, each a pure function from an
environment (a dict such as ``os.environ``) to an argv list, plus a CLI that
prints (``--dry-run`` or ``SPMDRL_DRY_RUN=1``) or execs the command:

    python -m spmdrl.launch local -- --config configs/grpo.yaml
    python -m spmdrl.launch multinode -- --config configs/grpo.yaml   # MASTER_ADDR, NNODES, ...
    srun --ntasks-per-node=1 python -m spmdrl.launch slurm -- --config configs/grpo.yaml

``launch/local.sh``, ``launch/multinode.sh`` and ``slurm/*.sbatch`` call this
module, so the rules live in one tested place. Before it execs torchrun, the
launcher runs the trainer's checks of the arguments once (``preflight``), so
bad input ends there with one line instead of in torchrun's restart loop.
Nothing here imports torch at module level: rendering a command (the dry run,
the CPU-only tests) needs no device. See docs/launch.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Optional

TRAIN_MODULE = "spmdrl.train"

# torchrun as a module of the interpreter this runs under, not the `torchrun` script on PATH: the sbatch
# scripts' PYTHON=/path/to/venv/bin/python alone then starts that environment's torchrun and trainers.
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")

# torchrun only forwards the signals it handles to its workers; SIGUSR1 is the
# one slurm/*.sbatch sends ahead of the time limit, and without it in this list
# torchrun would die from SIGUSR1's default action and orphan the trainers.
SLURM_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"

# The sbatch scripts ask for SIGUSR1 120 s before the time limit; torchrun must
# give the trainers most of that to reach a step boundary and save, but stop
# waiting early enough for the batch shell to requeue the job.
DEFAULT_SHUTDOWN_TIMEOUT = 100

# A crashed rank on a long multi-node run is usually transient (a flaky link, a
# node hiccup); torchrun restarts the whole group and the trainer resumes from
# its last checkpoint. Locally a crash is more likely a bug, so no restarts.
DEFAULT_MAX_RESTARTS = 3

DEFAULT_MULTINODE_PORT = 29500

# Slurm jobs sharing a node must not fight over one port; deriving it from the
# job id keeps it the same on every node and across requeues of one job.
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 20000

CPU_NPROC_PER_NODE = 2


class LaunchError(ValueError):
    """A launch environment that cannot produce a valid torchrun command."""


def expand_hostlist(spec: str) -> list[str]:
    """Expand a Slurm hostlist such as ``gpu[01-03,07],cpu5`` into host names.

    Follows ``scontrol show hostnames``: commas outside brackets separate
    hosts, each bracket holds numbers and ranges, zero padding of a range's
    start sets the width, and several bracket groups in one name expand as a
    cartesian product in order (``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2).
    """
    if not spec or not spec.strip():
        raise LaunchError("the Slurm node list is empty; expected something like 'gpu[01-04]'.")
    hosts: list[str] = []
    for pattern in _split_top_level(spec.strip()):
        hosts.extend(_expand_pattern(pattern, spec))
    return hosts


def _split_top_level(spec: str) -> list[str]:
    """Split at commas that are not inside brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(spec):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise LaunchError(f"nested brackets in Slurm node list {spec!r}.")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"unbalanced ']' in Slurm node list {spec!r}.")
        elif ch == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    if depth != 0:
        raise LaunchError(f"unbalanced '[' in Slurm node list {spec!r}.")
    parts.append(spec[start:])
    for part in parts:
        if not part:
            raise LaunchError(f"empty host name in Slurm node list {spec!r}.")
    return parts


_NAME_CHARS = re.compile(r"^[A-Za-z0-9._-]*$")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_pattern(pattern: str, spec: str) -> list[str]:
    """Expand one host pattern (no top-level commas) into its names."""
    # re.split with a capture group alternates literal text and bracket bodies.
    pieces = re.split(r"\[([^\]]*)\]", pattern)
    names = [""]
    for index, piece in enumerate(pieces):
        if index % 2 == 0:
            if not _NAME_CHARS.match(piece):
                raise LaunchError(
                    f"invalid character in host pattern {pattern!r} of Slurm node list {spec!r}."
                )
            names = [name + piece for name in names]
        else:
            names = [name + suffix for name in names for suffix in _expand_brackets(piece, pattern, spec)]
    return names


def _expand_brackets(body: str, pattern: str, spec: str) -> list[str]:
    """Expand the inside of one bracket group, e.g. ``01-03,07``."""
    out: list[str] = []
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise LaunchError(
                f"bad range {item!r} in host pattern {pattern!r} of Slurm node list {spec!r}; "
                "expected numbers like '3' or '01-04'."
            )
        lo_text, hi_text = match.group(1), match.group(2)
        lo = int(lo_text)
        hi = int(hi_text) if hi_text is not None else lo
        if hi < lo:
            raise LaunchError(f"descending range {item!r} in Slurm node list {spec!r}.")
        width = len(lo_text)
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def _int_at_least(value: str, name: str, source: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} from {source} is not an integer.") from None
    if number < minimum:
        bound = "0 or more" if minimum == 0 else f"at least {minimum}"
        raise LaunchError(f"{name}={value!r} from {source} must be {bound}.")
    return number


def _positive_int(value: str, name: str, source: str) -> int:
    return _int_at_least(value, name, source, 1)


def _non_negative_int(value: str, name: str, source: str) -> int:
    return _int_at_least(value, name, source, 0)


def _port(value: str, name: str, source: str) -> int:
    port = _positive_int(value, name, source)
    if port > 65535:
        raise LaunchError(f"{name}={value!r} from {source} is not a TCP port (1-65535).")
    return port


def _slurm_count(value: str, name: str) -> int:
    """Parse a per-node count as Slurm writes it: ``4``, ``4(x2)`` or ``a100:4``.

    A typed GPU request (``--gpus-per-node=a100:4``) shows up with its type;
    several types on one node (``a100:2,h100:2``) add up. Counts of the
    ``N(xM)`` form repeat N for M nodes, so N is the per-node count.
    """
    total = 0
    for item in value.split(","):
        count = item.strip().split(":")[-1]
        count = re.sub(r"\(x\d+\)$", "", count)
        total += _non_negative_int(count, name, "the Slurm environment")
    return total


def _max_tasks_per_node(value: str) -> int:
    """Largest count in a Slurm tasks-per-node list such as ``1(x2),2``."""
    counts = [re.sub(r"\(x\d+\)$", "", item.strip()) for item in value.split(",")]
    return max(_non_negative_int(c, "SLURM_STEP_TASKS_PER_NODE", "the Slurm environment") for c in counts)


def slurm_nproc_per_node(env: Mapping[str, str]) -> int:
    """Processes per node for a Slurm job: one per GPU, else one per Slurm task.

    NPROC_PER_NODE wins when set (e.g. several CPU ranks on a node that runs
    one launcher task). Then the GPUs Slurm gave this node
    (SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE), then, for CPU-only jobs,
    SLURM_NTASKS_PER_NODE.
    """
    if env.get("NPROC_PER_NODE"):
        return _positive_int(env["NPROC_PER_NODE"], "NPROC_PER_NODE", "the environment")
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        if env.get(name):
            count = _slurm_count(env[name], name)
            # Zero means "no GPUs here", so fall through to the CPU rule.
            if count > 0:
                return count
    if env.get("SLURM_NTASKS_PER_NODE"):
        tasks = re.sub(r"\(x\d+\)$", "", env["SLURM_NTASKS_PER_NODE"])
        return _positive_int(tasks, "SLURM_NTASKS_PER_NODE", "the Slurm environment")
    raise LaunchError(
        "cannot tell how many processes to start per node: set one of SLURM_GPUS_ON_NODE, "
        "SLURM_GPUS_PER_NODE (sbatch --gpus-per-node), SLURM_NTASKS_PER_NODE or NPROC_PER_NODE."
    )


def _require(env: Mapping[str, str], *names: str) -> tuple[str, str]:
    """The first of ``names`` that is set, as (name, value); error naming the first otherwise."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    hint = f" (or {', '.join(names[1:])})" if len(names) > 1 else ""
    raise LaunchError(
        f"{names[0]}{hint} is not set; run this inside a Slurm allocation (sbatch or srun), "
        "or use the 'local' or 'multinode' launcher."
    )


def _resolve_max_restarts(
    env: Mapping[str, str], max_restarts: Optional[int], default: Optional[int]
) -> Optional[int]:
    if max_restarts is not None:
        if max_restarts < 0:
            raise LaunchError(f"--max-restarts={max_restarts} must be 0 or more.")
        return max_restarts
    if env.get("MAX_RESTARTS"):
        return _non_negative_int(env["MAX_RESTARTS"], "MAX_RESTARTS", "the environment")
    return default


def slurm_torchrun_command(
    env: Mapping[str, str],
    train_args: Sequence[str],
    nproc_per_node: Optional[int] = None,
    max_restarts: Optional[int] = None,
    shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT,
) -> list[str]:
    """The torchrun argv for one node of a Slurm job (run once per node by srun).

    Every node renders the same command: c10d rendezvous on the first host of
    the node list, at MASTER_PORT (default 20000 + job id % 20000), with the
    job id as rendezvous id so that a requeued job meets only itself. Inside
    an srun step the step's node list and node count are used, so a step on a
    subset of the allocation does not wait for nodes that never join.
    """
    _, nodelist = _require(env, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if env.get("SLURM_STEP_NODELIST", "").strip():
        nodelist = env["SLURM_STEP_NODELIST"].strip()
    hosts = expand_hostlist(nodelist)

    nnodes_name, nnodes_text = _require(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if env.get("SLURM_STEP_NUM_NODES", "").strip():
        nnodes_name, nnodes_text = "SLURM_STEP_NUM_NODES", env["SLURM_STEP_NUM_NODES"].strip()
    nnodes = _positive_int(nnodes_text, nnodes_name, "the Slurm environment")
    if nnodes != len(hosts):
        raise LaunchError(
            f"{nnodes_name}={nnodes} does not match the {len(hosts)} hosts in node list {nodelist!r}."
        )

    # Two launcher tasks on one node would start two torchruns that each claim
    # a node slot, and the rendezvous would never complete.
    if env.get("SLURM_STEP_TASKS_PER_NODE", "").strip():
        tasks = _max_tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])
        if tasks > 1:
            raise LaunchError(
                f"SLURM_STEP_TASKS_PER_NODE={env['SLURM_STEP_TASKS_PER_NODE']!r} starts {tasks} launchers "
                "on a node; run one per node (srun --ntasks-per-node=1), torchrun starts the per-GPU "
                "processes."
            )

    job_name, job_text = _require(env, "SLURM_JOB_ID", "SLURM_JOBID")
    job_id = _non_negative_int(job_text, job_name, "the Slurm environment")
    if env.get("MASTER_PORT"):
        port = _port(env["MASTER_PORT"], "MASTER_PORT", "the environment")
    else:
        port = SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN

    if nproc_per_node is None:
        nproc_per_node = slurm_nproc_per_node(env)
    elif nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node={nproc_per_node} must be at least 1.")
    restarts = _resolve_max_restarts(env, max_restarts, DEFAULT_MAX_RESTARTS)
    if shutdown_timeout < 0:
        raise LaunchError(f"--shutdown-timeout={shutdown_timeout} must be 0 or more.")

    cmd = [
        *TORCHRUN,
        "--nnodes", str(nnodes),
        "--nproc-per-node", str(nproc_per_node),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{hosts[0]}:{port}",
        "--rdzv-id", job_text,
        "--max-restarts", str(restarts),
    ]
    # torchrun guesses whether it hosts the rendezvous store by matching the
    # endpoint against its own host names, which fails on nodes whose hostname
    # differs from the Slurm node name; Slurm tells us the truth, so say it.
    node_name = env.get("SLURMD_NODENAME", "").strip()
    if node_name:
        cmd += ["--rdzv-conf", f"is_host={'true' if node_name == hosts[0] else 'false'}"]
    cmd += [
        "--signals-to-handle", SLURM_SIGNALS,
        "--shutdown-timeout", str(shutdown_timeout),
        "-m", TRAIN_MODULE,
        *train_args,
    ]
    return cmd


def default_nproc_per_node() -> int:
    """One process per visible GPU, or CPU_NPROC_PER_NODE when there is none.

    torch is imported here, not at module level, because only this question
    needs it and the other launch paths should start instantly.
    """
    import torch

    count = torch.cuda.device_count()
    return count if count > 0 else CPU_NPROC_PER_NODE


def _nproc_from_env(env: Mapping[str, str], names: Sequence[str]) -> Optional[int]:
    for name in names:
        if env.get(name):
            return _positive_int(env[name], name, "the environment")
    return None


def local_torchrun_command(
    env: Mapping[str, str],
    train_args: Sequence[str],
    nproc_per_node: Optional[int] = None,
    max_restarts: Optional[int] = None,
) -> list[str]:
    """The single-node torchrun argv: ``--standalone`` and NPROC processes.

    NPROC (or NPROC_PER_NODE) sets the process count, else one per GPU, else 2
    on CPU. Restarts are off unless asked for (MAX_RESTARTS or the argument).
    """
    if nproc_per_node is None:
        nproc_per_node = _nproc_from_env(env, ("NPROC", "NPROC_PER_NODE"))
    if nproc_per_node is None:
        nproc_per_node = default_nproc_per_node()
    if nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node={nproc_per_node} must be at least 1.")
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(nproc_per_node)]
    restarts = _resolve_max_restarts(env, max_restarts, None)
    if restarts is not None:
        cmd += ["--max-restarts", str(restarts)]
    return cmd + ["-m", TRAIN_MODULE, *train_args]


def multinode_torchrun_command(
    env: Mapping[str, str],
    train_args: Sequence[str],
    nproc_per_node: Optional[int] = None,
    max_restarts: Optional[int] = None,
) -> list[str]:
    """The torchrun argv for one node of a hand-started (or non-Slurm) multi-node run.

    Reads MASTER_ADDR (required), MASTER_PORT (default 29500), NNODES
    (required), NODE_RANK (optional; 0 marks the node that hosts the
    rendezvous store), NPROC_PER_NODE (default: GPUs, else 2) and RDZV_ID
    (default ``spmdrl``; must be the same on every node). Run the same command
    on every node.
    """
    master_addr = _require_multinode(env, "MASTER_ADDR")
    port = DEFAULT_MULTINODE_PORT
    if env.get("MASTER_PORT"):
        port = _port(env["MASTER_PORT"], "MASTER_PORT", "the environment")
    nnodes = _positive_int(_require_multinode(env, "NNODES"), "NNODES", "the environment")
    if nproc_per_node is None:
        nproc_per_node = _nproc_from_env(env, ("NPROC_PER_NODE",))
    if nproc_per_node is None:
        nproc_per_node = default_nproc_per_node()
    if nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node={nproc_per_node} must be at least 1.")
    restarts = _resolve_max_restarts(env, max_restarts, DEFAULT_MAX_RESTARTS)
    rdzv_id = env.get("RDZV_ID", "").strip() or "spmdrl"

    cmd = [
        *TORCHRUN,
        "--nnodes", str(nnodes),
        "--nproc-per-node", str(nproc_per_node),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{master_addr}:{port}",
        "--rdzv-id", rdzv_id,
        "--max-restarts", str(restarts),
    ]
    # With c10d the node rank does not order anything (the rendezvous assigns
    # ranks); it only lets us tell torchrun which node serves the store when
    # MASTER_ADDR is an address torchrun cannot match to its own hostname.
    if env.get("NODE_RANK", "").strip():
        node_rank = _non_negative_int(env["NODE_RANK"], "NODE_RANK", "the environment")
        if node_rank >= nnodes:
            raise LaunchError(f"NODE_RANK={node_rank} from the environment must be below NNODES={nnodes}.")
        cmd += ["--rdzv-conf", f"is_host={'true' if node_rank == 0 else 'false'}"]
    return cmd + ["-m", TRAIN_MODULE, *train_args]


def _require_multinode(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise LaunchError(
            f"{name} is not set; the multinode launcher needs MASTER_ADDR and NNODES on every node."
        )
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m spmdrl.launch",
        description="Render (--dry-run) or exec the torchrun command that starts python -m spmdrl.train. "
        "Arguments after '--' go to the trainer.",
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    modes = {
        "local": "one node, torchrun --standalone (NPROC sets the process count)",
        "multinode": "one node of a multi-node run from MASTER_ADDR/MASTER_PORT/NNODES/NODE_RANK",
        "slurm": "one node of a Slurm job (run with srun --ntasks-per-node=1)",
    }
    for mode, help_text in modes.items():
        p = sub.add_parser(mode, help=help_text, description=help_text)
        p.add_argument(
            "--dry-run",
            action="store_true",
            help="print the command instead of running it (also SPMDRL_DRY_RUN=1)",
        )
        p.add_argument(
            "--nproc-per-node", type=int, default=None, help="processes per node (default: from env)"
        )
        p.add_argument(
            "--max-restarts",
            type=int,
            default=None,
            help="torchrun restarts of the whole group (also MAX_RESTARTS)",
        )
        if mode == "slurm":
            p.add_argument(
                "--shutdown-timeout",
                type=int,
                default=DEFAULT_SHUTDOWN_TIMEOUT,
                help="seconds torchrun waits for trainers to checkpoint after a signal before killing them; "
                "keep it below the sbatch --signal lead time",
            )
    return parser


def build_command(
    mode: str,
    env: Mapping[str, str],
    train_args: Sequence[str],
    nproc_per_node: Optional[int] = None,
    max_restarts: Optional[int] = None,
    shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT,
) -> list[str]:
    """The torchrun argv for ``mode`` (``local``, ``multinode`` or ``slurm``)."""
    if mode == "slurm":
        return slurm_torchrun_command(env, train_args, nproc_per_node, max_restarts, shutdown_timeout)
    if mode == "multinode":
        return multinode_torchrun_command(env, train_args, nproc_per_node, max_restarts)
    if mode == "local":
        return local_torchrun_command(env, train_args, nproc_per_node, max_restarts)
    raise LaunchError(f"unknown launch mode {mode!r}; expected one of local, multinode, slurm.")


def preflight(cmd: Sequence[str]) -> None:
    """The trainer's own checks of its arguments (``spmdrl.train.checked``) at the world size ``cmd`` starts,
    run here once: bad input exits 2 with one error line before torchrun starts, instead of a line per rank
    repeated at each of torchrun's restarts (and ``--help`` prints once, exiting 0)."""
    from torch.distributed.run import get_args_parser

    from spmdrl.config.parse import exit_with
    from spmdrl.errors import ConfigError
    from spmdrl.train import checked

    args = get_args_parser().parse_args(list(cmd[len(TORCHRUN):]))
    nproc, nnodes = int(args.nproc_per_node), int(str(args.nnodes).split(":")[-1])
    try:
        checked(args.training_script_args, nnodes * nproc, nproc)
    except ConfigError as err:
        exit_with(err, debug="--debug" in args.training_script_args)


def main(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None) -> int:
    """CLI entry: returns 2 on a bad environment, exits 2 on a bad config; execs torchrun (never returns)
    otherwise."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if env is None else env
    # Split by hand: argparse would try to read trainer flags such as --config
    # as its own, and '--' inside a subparser is not handled consistently.
    if "--" in argv:
        cut = argv.index("--")
        launcher_args, train_args = argv[:cut], argv[cut + 1:]
    else:
        launcher_args, train_args = argv, []
    args = _parser().parse_args(launcher_args)
    try:
        cmd = build_command(
            args.mode,
            env,
            train_args,
            nproc_per_node=args.nproc_per_node,
            max_restarts=args.max_restarts,
            shutdown_timeout=getattr(args, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT),
        )
    except LaunchError as err:
        print(f"spmdrl.launch: error: {err}", file=sys.stderr)
        return 2
    if args.dry_run or env.get("SPMDRL_DRY_RUN", "") not in ("", "0"):
        print(shlex.join(cmd), flush=True)
        return 0
    preflight(cmd)
    print(f"spmdrl.launch: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    # torchrun 2.13 keeps one TCPStore across restarts; keys of a killed attempt can point the
    # restarted group at dead peers (pytorch#135712). A fresh store per attempt avoids that.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main())
