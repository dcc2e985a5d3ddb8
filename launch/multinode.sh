#!/usr/bin/env bash
# Start one node of a multi-node spmdrl run (no scheduler, or one that is not
# Slurm): torchrun with c10d rendezvous. Run the same command on every node.
#
#   MASTER_ADDR=node0 NNODES=2 NODE_RANK=0 launch/multinode.sh --config configs/grpo.yaml
#   MASTER_ADDR=node0 NNODES=2 NODE_RANK=1 launch/multinode.sh --config configs/grpo.yaml
#
# Environment: MASTER_ADDR (required; the node that hosts the rendezvous),
# MASTER_PORT (default 29500), NNODES (required), NODE_RANK (optional; 0 marks
# the MASTER_ADDR node), NPROC_PER_NODE (default: GPUs, else 2), RDZV_ID
# (default spmdrl; same on every node), MAX_RESTARTS (default 3), PYTHON,
# SPMDRL_DRY_RUN=1 (print the torchrun command instead of running it).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# A fresh checkout works without `pip install -e .`; torchrun's workers inherit
# the path, so they import the same spmdrl as the launcher.
export PYTHONPATH="${repo_root}${PYTHONPATH:+:${PYTHONPATH}}"

exec "${PYTHON:-python}" -m spmdrl.launch multinode -- "$@"
