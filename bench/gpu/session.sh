#!/usr/bin/env bash
# One whole GPU measurement in the fewest device calls (docs/gpu.md, "A session"): each call of the device tool
# runs one step of this script, carrying the one chunk that step names, back to back while the machine is warm.
#
#   bash bench/gpu/session.sh native        # carry .carry/c1: install it, then the native cells with each
#                                           # candidate flag on and off, on the 0.5B shape
#   bash bench/gpu/session.sh native-more   # carry .carry/c1: the decode loop without CUDA graphs, Megatron,
#                                           # checkpoint, the 1.5B shape
#   bash bench/gpu/session.sh install 2     # carry .carry/c2: install only (and c3 the same)
#   bash bench/gpu/session.sh vllm 4        # carry .carry/c4, the last of vLLM's chunks (with TRL's wheels;
#                                           # build_carry.py prints which): install it, then TRL 1.16 with
#                                           # vLLM, spmdrl with vLLM, vLLM alone, then spmdrl with vLLM
#                                           # measuring its log-prob gap to the actor (weights reach graphs)
#   bash bench/gpu/session.sh --dry-run native   # the same cells on CPU at tiny sizes, no install (the test's)
#
# Every result and log goes under $OUT/<step>/ (results.json, matrix.log): the device tool brings back at most
# 8 files, so the runs' own folders stay in /tmp. Within a step the cells run in the order to keep when time
# runs short: a call cut off by its time limit still leaves results.json with every cell finished before.
set -euo pipefail
cd "$(dirname "$0")/../.."

dry=0
if [[ "${1:-}" == "--dry-run" ]]; then dry=1; shift; fi
step="${1:?usage: session.sh [--dry-run] native | native-more | install N | vllm N}"
out="${OUT:-bench/gpu/out}/$step"
runs="${TMPDIR:-/tmp}/spmdrl-session-runs"
python=python3
sized=()
install=()
if (( dry )); then
    python="${PYTHON:-python}"
    sized=(--device cpu --model builtin:tiny --second-model builtin:tiny --steps 2 --prompts 2 --n 2 --new-tokens 4
           --micro 4)
fi
matrix() { "$python" bench/gpu/matrix.py --out "$out" --runs "$runs" "${sized[@]}" "$@"; }

# The candidate speed-ups, each a flag of spmdrl.train, so one call measures each on and off. "main" is
# the decode loop as it was before CUDA graphs, "eager" the training forward without torch.compile (its
# CUDA default since 2026-11-28); the default cell is today's defaults.
variants=(
    --variant "main=--rollout.native_cuda_graphs off"
    --variant "awake=--rollout.free_cache_engine false"
    --variant "eager=--model.use_torch_compile false"
    --variant "micro128=--actor.ppo_micro_batch_size_per_gpu 128"
    --variant "gap=--rollout.calculate_log_probs true"
)

case "$step" in
    native)
        (( dry )) || install=(--install .carry/c1)
        matrix "${install[@]}" --shapes sized "${variants[@]}" \
            --cells fsdp2-native fsdp2-native+eager fsdp2-native+micro128 fsdp2-native+awake
        ;;
    native-more)  # what a session with device time to spare adds (c1 again: a fresh machine may run it)
        (( dry )) || install=(--install .carry/c1)
        matrix "${install[@]}" --shapes sized "${variants[@]}" \
            --cells fsdp2-native+main megatron-native checkpoint
        # The same cells on the second size (on CPU the same tiny model again: nothing new to check there).
        (( dry )) || matrix --out "$out-1.5b" --shapes sized-1.5b "${variants[@]}" \
            --cells fsdp2-native+main fsdp2-native
        ;;
    install)
        chunk="${2:?usage: session.sh install N}"
        "$python" bench/gpu/matrix.py --install ".carry/c$chunk" --no-run
        ;;
    vllm)
        (( dry )) || install=(--install ".carry/c${2:?usage: session.sh vllm N}")
        matrix "${install[@]}" --shapes sized "${variants[@]}" \
            --cells trl-vllm fsdp2-vllm-sleep1 vllm-alone fsdp2-vllm-sleep1+gap
        ;;
    *)
        echo "session.sh: unknown step '$step'; steps: native, native-more, install N, vllm N" >&2
        exit 2
        ;;
esac
