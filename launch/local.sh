#!/usr/bin/env bash
# Start spmdrl on this machine: torchrun --standalone, one process per GPU (2 on CPU).
#
#   launch/local.sh --config configs/grpo.yaml [--section.key value ...]
#
# Environment: NPROC (process count), MAX_RESTARTS (torchrun restarts, default
# none), PYTHON (interpreter, default python), SPMDRL_DRY_RUN=1 (print the
# torchrun command instead of running it). The rules live in spmdrl/launch.py
# so that this script, the multi-node one and Slurm agree and are tested once.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# A fresh checkout works without `pip install -e .`; torchrun's workers inherit
# the path, so they import the same spmdrl as the launcher.
export PYTHONPATH="${repo_root}${PYTHONPATH:+:${PYTHONPATH}}"

exec "${PYTHON:-python}" -m spmdrl.launch local -- "$@"
