"""The GPU measurement matrix in one command: install carried wheels, run every cell, write results and a log.

    python3 bench/gpu/matrix.py --install .carry/c1           # on the GPU machine: c1, then the matrix
    python3 bench/gpu/matrix.py --install .carry/c2 --no-run  # a later chunk (vLLM's parts): install only
    python3 bench/gpu/matrix.py --device cpu --model builtin:tiny --steps 2 --prompts 2 --n 2 --new-tokens 4
                                                              # the CPU dry run the test suite does

``--install`` checks each chunk's files against its ``chunk.json`` (sha256), joins a wheel cut into parts
once all its parts have arrived (they travel in separate commands while the machine is warm), and installs
the wheels with pip (``--no-index --no-deps``: the image's torch is never replaced) into ``--site``, merged
so that namespace packages split over chunks survive. The runs then see ``--site`` after the checkout.

Each cell is one GRPO run on one rank, ``python -m spmdrl.train`` of configs/grpo.yaml, in its own process:
fsdp2-native, fsdp2-vllm-sleep1, fsdp2-vllm-sleep2, megatron-native, checkpoint (fsdp2-native saved at its
last step, then resumed for one more); beside them vllm-alone (vLLM's own generate of one rollout's work)
and trl-vllm (the peer: TRL's GRPOTrainer with vLLM colocated in sleep mode, bench/trl_grpo.py, on the same
model, data, batch, n, lengths and mini- and micro-batches; on ``--device cpu`` with transformers'
generate, as vLLM is not there). For each shape: ``default`` (configs/grpo.yaml's own sizes and model) and
``sized`` (``--model``, by default builtin:qwen2.5-0.5b-shape, ``--prompts`` x ``--n`` responses of exactly
``--new-tokens`` tokens: rollout.ignore_eos, so every row is equal work) and ``sized-1.5b`` (the same work
on builtin:qwen2.5-1.5b-shape, asked for by name). A cell that fails is recorded with its error and the
matrix goes on. Per cell, from the run's metrics.jsonl (trl-vllm's steps written as such rows; the first
step is warm-up and left out when there are more), medians of:

- tokens/s/GPU: prompt + response tokens per second of step, per rank (perf/tokens_per_s / world);
- seconds per step and per phase (timing/*); rollout decode tokens/s/GPU (response tokens / rollout s);
- weight sync: timing/weight_sync (waking the engine's weights and loading the actor's) and GB/s over the
  model's bytes in the rollout dtype;
- memory per phase: torch.cuda.max_memory_allocated (RSS on CPU) and NVML's device-wide used memory; the
  colocated peak over the larger of the rollout and update phases (the goal is <= 1.1); beside them the
  memory plan's predicted peak of each phase (the run's plan.json);
- where the time goes besides the named phases: timing/other (what no phase covered) and offload (the
  optimizer state's moves around rollout, when the plan decided them);
- MFU of the update: 6 x parameters x tokens / update s / the device's dense bf16 peak (``--peak-tflops``;
  989 for an H100 or H200), attention FLOPs left out.

Writes ``results.json`` (after every cell) and ``matrix.log`` (each run's output) into ``--out`` ($OUT when
set, as on the lent machine, so both come back).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
CELLS: dict[str, list[str]] = {
    "fsdp2-native": [],
    "fsdp2-vllm-sleep1": ["--rollout.engine", "vllm", "--rollout.sleep_level", "1"],
    "fsdp2-vllm-sleep2": ["--rollout.engine", "vllm", "--rollout.sleep_level", "2"],
    "megatron-native": ["--actor.strategy", "megatron"],
    "checkpoint": [],
    "vllm-alone": [],  # bench/gpu/vllm_alone.py: vLLM's own generate of one rollout's work
    "trl-vllm": [],  # bench/trl_grpo.py: TRL's GRPOTrainer with colocated vLLM on the same work
}
# sized-1.5b: the sized work on Qwen2.5-1.5B's shapes, so the table shows how cost grows with the model
SHAPES = ("default", "sized", "sized-1.5b")
SECOND_SIZE = "builtin:qwen2.5-1.5b-shape"
# Dense bf16 tensor-core peak, TFLOP/s, by a word of torch.cuda.get_device_name().
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}
LOG_TAIL = 200_000  # characters of one run's output kept in matrix.log


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _joined_wheels(chunk: Path, files: list[dict], parts: Path) -> list[Path]:
    """Parts of this chunk into ``parts``; every wheel whose parts are now all there, joined and checked."""
    done = []
    for e in files:
        if "part_of" not in e:
            continue
        shutil.copyfile(chunk / e["file"], parts / e["file"])
        have = [parts / f"{e['part_of']}.part{i:02d}" for i in range(e["parts"])]
        whole = parts / e["part_of"]
        if all(p.exists() for p in have) and not whole.exists():
            with open(whole, "wb") as out:
                for p in have:
                    out.write(p.read_bytes())
            if sha256(whole) != e["whole_sha256"]:
                raise SystemExit(f"{whole}: joined parts do not match the sha256 in {chunk / 'chunk.json'}")
            done.append(whole)
    return done


def install(chunks: list[Path], site: Path) -> list[str]:
    """Install the wheels of ``chunks`` into ``site``; returns the wheel names installed."""
    parts = site.parent / f"{site.name}.parts"
    parts.mkdir(parents=True, exist_ok=True)
    installed = []
    for chunk in chunks:
        files = json.loads((chunk / "chunk.json").read_text())["files"]
        for e in files:
            if sha256(chunk / e["file"]) != e["sha256"]:
                raise SystemExit(f"{chunk / e['file']}: sha256 differs from {chunk / 'chunk.json'}")
        wheels = [chunk / e["file"] for e in files if "part_of" not in e]
        wheels += _joined_wheels(chunk, files, parts)
        if not wheels:
            continue
        # pip --target replaces a top-level folder that a wheel brings again (opentelemetry/ of several
        # distributions): install into a fresh folder, then merge into site.
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                            "--no-compile", "--no-cache-dir", "--target", tmp, *map(str, wheels)], check=True)
            shutil.copytree(tmp, site, dirs_exist_ok=True)
        installed += [w.name for w in wheels]
    return installed


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "host": platform.node()}
    for name in ("transformers", "vllm", "megatron-core", "jsonargparse", "spmdrl"):
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gb"] = torch.cuda.get_device_properties(0).total_memory / 1024**3
    smi = shutil.which("nvidia-smi")
    if smi:
        query = [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        info["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    return info


def count_params(folder: Path) -> int:
    """Elements of every tensor in the folder's safetensors files (headers only)."""
    total = 0
    for f in Path(folder).glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def shape_of(shape: str, a: argparse.Namespace) -> dict[str, Any]:
    """The shape's training arguments, model path, prompts per step, responses per prompt, new tokens, prompts
    per optimizer step, responses per micro-batch and whether responses run to exactly ``new_tokens``."""
    import yaml

    if shape == "default":
        cfg = yaml.safe_load((REPO / "configs" / "grpo.yaml").read_text())
        return {"args": [], "model": cfg["model"]["path"], "prompts": cfg["data"]["train_batch_size"],
                "n": cfg["rollout"]["n"], "new_tokens": cfg["data"]["max_response_length"],
                "mini": cfg["actor"]["ppo_mini_batch_size"],
                "micro": cfg["actor"]["ppo_micro_batch_size_per_gpu"], "ignore_eos": False}
    model = a.second_model if shape == "sized-1.5b" else a.model
    args = ["--model.path", model, "--data.train_batch_size", str(a.prompts),
            "--actor.ppo_mini_batch_size", str(a.prompts), "--rollout.n", str(a.n),
            "--data.max_response_length", str(a.new_tokens),
            "--actor.ppo_micro_batch_size_per_gpu", str(a.micro), "--rollout.ignore_eos", "true"]
    return {"args": args, "model": model, "prompts": a.prompts, "n": a.n, "new_tokens": a.new_tokens,
            "mini": a.prompts, "micro": a.micro, "ignore_eos": True}


def train(args: list[str], out: Path, log: Path, title: str, timeout: float, site: Path) -> tuple[int, str]:
    """One ``python -m spmdrl.train`` run of configs/grpo.yaml with ``args``; (exit code, output)."""
    return child("spmdrl.train", ["--config", "configs/grpo.yaml", *args, "--trainer.output_dir", str(out),
                                  "--trainer.logger", "[jsonl]", "--trainer.progress_bar", "false"],
                 log, title, timeout, site)


def child(target: str, args: list[str], log: Path, title: str, timeout: float, site: Path) -> tuple[int, str]:
    """Run a module (or a script: a path ending in .py) in a child Python; its output is appended to ``log``;
    (exit code, output). ``site.addsitedir`` runs the ``.pth`` files of the carried wheels
    (nvidia-cutlass-dsl's puts its packages on the path), which a folder on PYTHONPATH never runs."""
    run = (f"runpy.run_path({target!r}, run_name='__main__')" if target.endswith(".py")
           else f"runpy.run_module({target!r}, run_name='__main__', alter_sys=True)")
    cmd = [sys.executable, "-c", f"import runpy, site, sys; site.addsitedir({str(site)!r}); "
                                 f"sys.argv[0] = {target!r}; {run}", *args]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        rc, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, f"{e.stdout or ''}{e.stderr or ''}\n[matrix] timed out after {timeout:.0f} s"
    with open(log, "a") as f:
        f.write(f"\n===== {title} (rc={rc}, {time.perf_counter() - start:.1f} s)\n$ {' '.join(cmd)}\n")
        f.write(text[-LOG_TAIL:])
    return rc, text


def figures(rows: list[dict], *, world: int, responses: int, params: int, weight_bytes: int,
            peak_tflops: Optional[float]) -> dict[str, Any]:
    """The item-4 figures of one run from its metrics rows (the first left out as warm-up when more)."""
    # Step 1's engine starts with the actor's weights: its weight_sync phase only wakes it, loading nothing.
    loads = [r["timing/weight_sync"] for r in rows if r.get("step", 0) > 1 and "timing/weight_sync" in r]
    rows = rows[1:] if len(rows) > 1 else rows

    def med(key: str) -> Optional[float]:
        vals = [r[key] for r in rows if key in r and r[key] == r[key]]
        return statistics.median(vals) if vals else None

    def peak(key: str) -> Optional[float]:
        vals = [r[key] for r in rows if key in r and r[key] == r[key]]
        return max(vals) if vals else None

    phases = sorted({k[7:] for r in rows for k in r if k.startswith("timing/")} - {"step"})
    step_s, tokens = med("timing/step"), med("perf/tokens_per_s")
    f: dict[str, Any] = {"steps_measured": len(rows), "step_s": step_s,
                         "tokens_per_s_per_gpu": tokens / world if tokens else None,
                         "response_length": med("response_length/mean"),
                         "phase_s": {p: med(f"timing/{p}") for p in phases},
                         "peak_gb": {p: peak(f"memory/{p}_peak_gb") for p in phases},
                         "nvml_gb": {p: peak(f"memory/{p}_nvml_gb") for p in phases},
                         "overall_peak_gb": peak("memory/overall_peak_gb"),
                         # The rollout's log-probs against the actor's (a weight-sync check: at bf16 noise
                         # when the weights pushed after a CUDA graph's capture reach it; needs
                         # rollout.calculate_log_probs, the session's "gap" variant).
                         "rollout_gap": {"kl": peak("rollout_corr/kl"),
                                         "log_ppl_abs_diff": peak("rollout_corr/log_ppl_abs_diff")},
                         "params": params, "weight_gb": params * weight_bytes / 1e9}
    f["offload_s"] = (f["phase_s"].get("offload") or 0.0) + (f["phase_s"].get("onload") or 0.0)
    rollout, update = f["phase_s"].get("rollout"), f["phase_s"].get("update")
    f["weight_sync_s"] = sync = statistics.median(loads) if loads else None
    f["weight_sync_gb_per_s"] = f["weight_gb"] / sync if sync else None
    if rollout and f["response_length"]:
        f["decode_tokens_per_s_per_gpu"] = responses / world * f["response_length"] / rollout
    for kind in ("peak_gb", "nvml_gb"):
        larger = max((v for p, v in f[kind].items() if p in ("rollout", "update") and v), default=None)
        top = max((v for v in f[kind].values() if v), default=None)
        f[f"colocated_over_larger_phase_{kind[:-3]}"] = top / larger if larger and top else None
    f["update_mfu"] = None
    if peak_tflops and update and f["tokens_per_s_per_gpu"] and step_s:
        flops = 6 * params * f["tokens_per_s_per_gpu"] * step_s
        f["update_mfu"] = flops / update / (peak_tflops * 1e12)
    return f


def planned(out: Path) -> dict[str, float]:
    """The memory plan's predicted peak GB per phase (plan.json; GiB as the metrics), or none."""
    path = out / "plan.json"
    return json.loads(path.read_text())["peak_gb"] if path.exists() else {}


def read_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def checkpoint_cell(sh: dict[str, Any], common: list[str], out: Path, a: argparse.Namespace,
                    title: str) -> tuple[int, str, dict[str, Any]]:
    """Save at the last step, then resume from it for one more step; (exit code, output, what happened)."""
    rc, text = train([*common, "--trainer.save_freq", str(a.steps), "--trainer.resume", "off"], out, a.log,
                     f"{title} save", a.cell_timeout, a.site)
    if rc == 0:
        more = [*sh["args"], "--trainer.device", a.device, "--trainer.total_steps", str(a.steps + 1),
                "--trainer.resume", "auto"]
        rc, resumed = train(more, out, a.log, f"{title} resume", a.cell_timeout, a.site)
        text += resumed
    saved = re.search(r"\[checkpoint\] saved \S+ \(([\d.]+) MiB\) in ([\d.]+) s", text)
    back = re.search(r"\[checkpoint\] resumed from \S+ at step (\d+) in ([\d.]+) s", text)
    steps = [r["step"] for r in read_rows(out)]
    return rc, text, {"saved_mib": float(saved[1]) if saved else None,
                      "save_s": float(saved[2]) if saved else None,
                      "resumed_step": int(back[1]) if back else None,
                      "resume_s": float(back[2]) if back else None, "steps_logged": steps,
                      "resumed_ok": bool(back) and int(back[1]) == a.steps
                      and steps == list(range(1, a.steps + 2))}


def vllm_alone_cell(sh: dict[str, Any], a: argparse.Namespace, title: str) -> tuple[int, str, dict[str, Any]]:
    """vLLM's own generate of one rollout's work (bench/gpu/vllm_alone.py)."""
    from spmdrl.builtin.models import resolve_builtin_model

    args = [resolve_builtin_model(sh["model"]), "--prompts", str(sh["prompts"]), "--n", str(sh["n"]),
            "--new-tokens", str(sh["new_tokens"])]
    script = str(REPO / "bench" / "gpu" / "vllm_alone.py")
    rc, text = child(script, args, a.log, title, a.cell_timeout, a.site)
    last = [line for line in text.splitlines() if line.startswith("{")]
    return rc, text, json.loads(last[-1]) if rc == 0 and last else {}


def trl_cell(sh: dict[str, Any], a: argparse.Namespace, out: Path,
             title: str) -> tuple[int, str, dict[str, Any]]:
    """TRL's GRPOTrainer on the shape's model, data (configs/grpo.yaml's train files), batch, n, lengths and
    mini- and micro-batches (bench/trl_grpo.py): with colocated vLLM in bf16 on CUDA, with transformers'
    generate in float32 on CPU. Its steps are written to ``out/metrics.jsonl`` as spmdrl's metric rows
    (timing/*, perf/tokens_per_s, response_length/mean), so that the cell has the same figures."""
    import yaml

    from spmdrl.builtin.models import resolve_builtin_model
    from spmdrl.builtin.tasks import resolve_builtin_data

    cfg = yaml.safe_load((REPO / "configs" / "grpo.yaml").read_text())
    data = resolve_builtin_data(cfg["data"]["train_files"], "train")
    args = ["--model", resolve_builtin_model(sh["model"]), "--data", data, "--steps", str(a.steps),
            "--prompts", str(sh["prompts"]), "--n", str(sh["n"]), "--new-tokens", str(sh["new_tokens"]),
            "--mini", str(sh["mini"]), "--micro", str(sh["micro"]),
            "--ignore-eos" if sh["ignore_eos"] else "--no-ignore-eos",
            "--beta", str(cfg["actor"]["kl_loss_coef"]), "--lr", str(cfg["actor"]["lr"]),
            "--max-prompt-length", str(cfg["data"]["max_prompt_length"]), "--device", a.device,
            "--out", str(out / "trl")]
    generate = "vllm" if a.device == "cuda" else "transformers"
    if generate == "vllm":
        args += ["--vllm", "--bf16"]
    rc, text = child(str(REPO / "bench" / "trl_grpo.py"), args, a.log, title, a.cell_timeout, a.site)
    last = [line for line in text.splitlines() if line.startswith("{\"step_s\"")]
    if rc != 0 or not last:
        return rc or 1, text, {}
    steps = json.loads(last[-1])
    rows = [{"step": i, "timing/step": s, **{f"timing/{k}": v for k, v in phases.items()},
             "perf/tokens_per_s": tokens / s, "response_length/mean": length}
            for i, (s, tokens, length, phases) in enumerate(zip(
                steps["step_s"], steps["tokens"], steps["response_length"], steps["phase_s"]), 1)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rc, text, {"generate": generate, "optimizer_steps_per_step": sh["prompts"] // sh["mini"]}


def run_cell(shape: str, cell: str, a: argparse.Namespace, ctx: dict[str, Any]) -> dict[str, Any]:
    """One cell (``base`` or ``base+variant``): its runs, then its figures; an error is recorded, never
    raised."""
    sh = shape_of(shape, a)
    out = a.runs / f"{shape}-{cell}"
    shutil.rmtree(out, ignore_errors=True)
    base, _, variant = cell.partition("+")
    # A variant's arguments come after the cell's own, so they override the shape's (--micro, say).
    extra = shlex.split(a.variants[variant]) if variant else []
    common = [*sh["args"], *CELLS[base], "--trainer.device", a.device, "--trainer.total_steps", str(a.steps),
              *extra]
    start, title = time.perf_counter(), f"{shape} {cell}"
    result: dict[str, Any] = {"shape": shape, "cell": cell, "model": sh["model"], "variant_args": extra}
    try:
        if base == "checkpoint":
            rc, text, result["checkpoint"] = checkpoint_cell(sh, common, out, a, title)
        elif base == "vllm-alone":
            rc, text, result["vllm_alone"] = vllm_alone_cell(sh, a, title)
        elif base == "trl-vllm":
            out.mkdir(parents=True)
            rc, text, result["trl"] = trl_cell(sh, a, out, title)
        else:
            rc, text = train([*common, "--trainer.resume", "off"], out, a.log, title, a.cell_timeout, a.site)
    except Exception as err:  # the matrix goes on; the cell says what broke
        rc, text = 1, f"[matrix] {type(err).__name__}: {err}"
    result.update(rc=rc, wall_s=time.perf_counter() - start)
    if rc != 0:
        result["error"] = text[-3000:]
    rows = read_rows(out)
    if rows:
        result["figures"] = figures(rows, world=1, responses=sh["prompts"] * sh["n"],
                                    params=ctx["params"][sh["model"]], weight_bytes=ctx["weight_bytes"],
                                    peak_tflops=ctx["peak_tflops"])
        result["figures"]["planned_peak_gb"] = planned(out)
    return result


def table(cells: list[dict[str, Any]]) -> str:
    """The cells as a Markdown table (what docs/gpu.md's measured table is made of)."""
    alone = {c["shape"]: c["vllm_alone"]["decode_tokens_per_s"] for c in cells if c.get("vllm_alone")}
    head = ("| shape | cell | rc | tokens/s/GPU | s/step | rollout s | update s | sync s | other s "
            "| offload s | sync GB/s | peak GB | planned GB | NVML GB | peak / larger phase "
            "| decode tok/s/GPU | vs vLLM alone | update MFU |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]

    def cell_text(v: Any, digits: int = 2) -> str:
        return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)

    for c in cells:
        f = c.get("figures") or {}
        if c["cell"] == "vllm-alone":
            f = {"decode_tokens_per_s_per_gpu": (c.get("vllm_alone") or {}).get("decode_tokens_per_s")}
        phase, decode = f.get("phase_s", {}), f.get("decode_tokens_per_s_per_gpu")
        vs = decode / alone[c["shape"]] if "vllm" in c["cell"] and decode and alone.get(c["shape"]) else None
        nvml = max((v for v in f.get("nvml_gb", {}).values() if v), default=None)
        plan = max(f.get("planned_peak_gb", {}).values(), default=None)
        row = [c["shape"], c["cell"], c["rc"], f.get("tokens_per_s_per_gpu"), f.get("step_s"),
               phase.get("rollout"), phase.get("update"), f.get("weight_sync_s"), phase.get("other"),
               f.get("offload_s"), f.get("weight_sync_gb_per_s"), f.get("overall_peak_gb"), plan, nvml,
               f.get("colocated_over_larger_phase_peak"), decode, vs, f.get("update_mfu")]
        lines.append("| " + " | ".join(cell_text(v, 3 if i in (7, 8, 9, 14, 16, 17) else 1 if i in (3, 15)
                                                 else 2) for i, v in enumerate(row)) + " |")
    return "\n".join(lines) + "\n"


def prepare(a: argparse.Namespace, shapes: list[str]) -> dict[str, Any]:
    """Build each shape's model once (timed) and read its size; the device's peak and the weights' width."""
    import torch

    from spmdrl.builtin.models import resolve_builtin_model
    from spmdrl.precision import resolve_dtype

    ctx: dict[str, Any] = {"params": {}, "build_s": {}}
    for shape in shapes:
        model = shape_of(shape, a)["model"]
        start = time.perf_counter()
        ctx["params"][model] = count_params(Path(resolve_builtin_model(model)))
        ctx["build_s"][model] = time.perf_counter() - start
    ctx["weight_bytes"] = resolve_dtype("auto", a.device).itemsize
    ctx["peak_tflops"] = a.peak_tflops
    if ctx["peak_tflops"] is None and a.device == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        ctx["peak_tflops"] = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return ctx


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--install", nargs="*", type=Path, default=[],
                   help="chunk folders (.carry/cN) to install first")
    p.add_argument("--site", type=Path, default=Path(tempfile.gettempdir()) / "spmdrl-site",
                   help="where carried wheels go (kept between commands while the machine is warm)")
    p.add_argument("--no-run", action="store_true", help="install only")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "bench" / "gpu" / "out")))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shapes", nargs="+", default=["default", "sized"], choices=SHAPES)
    p.add_argument("--cells", nargs="+", default=list(CELLS), metavar="CELL[+VARIANT]",
                   help=f"cells: {', '.join(CELLS)}; CELL+VARIANT runs it with a --variant's arguments")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                   help="spmdrl.train arguments of a variant (after the cell's own), e.g. "
                        "'eager=--rollout.native_cuda_graphs off': one call compares a flag on and off")
    p.add_argument("--runs", type=Path, default=None,
                   help="where each cell's run folder goes (default: OUT/runs; the device tool brings back "
                        "8 files at most, so a session keeps them out of OUT)")
    p.add_argument("--model", default="builtin:qwen2.5-0.5b-shape", help="the sized shape's model.path")
    p.add_argument("--second-model", default=SECOND_SIZE, help="the sized-1.5b shape's model.path")
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is warm-up")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--micro", type=int, default=32,
                   help="actor.ppo_micro_batch_size_per_gpu of the sized shape")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak for MFU (default: by GPU name)")
    p.add_argument("--cell-timeout", type=float, default=540,
                   help="seconds one run may take (a command on the lent machines may take 600)")
    a = p.parse_args(argv)
    a.variants = {}
    for spec in a.variant:
        name, eq, args = spec.partition("=")
        if not eq or not name or "+" in name:
            p.error(f"--variant {spec!r}: write NAME=ARGS, NAME without '+'")
        a.variants[name] = args
    for cell in a.cells:
        base, plus, variant = cell.partition("+")
        if base not in CELLS:
            p.error(f"--cells {cell}: unknown cell {base!r}; cells: {', '.join(CELLS)}")
        if plus and variant not in a.variants:
            p.error(f"--cells {cell}: no --variant {variant}=ARGS was given")
        if plus and base in ("vllm-alone", "trl-vllm"):
            p.error(f"--cells {cell}: {base} is no spmdrl.train run; variants change those only")
    a.runs = a.runs or a.out / "runs"
    return a


def main(argv: Optional[list[str]] = None) -> None:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    a.log = a.out / "matrix.log"
    a.site.mkdir(parents=True, exist_ok=True)
    installed = install(a.install, a.site)
    print(f"[matrix] installed {len(installed)} wheels into {a.site}", flush=True)
    if a.no_run:
        return
    # The checkout first (a fix made there wins over spmdrl's carried wheel), then the carried wheels.
    path = [str(REPO), str(a.site), *filter(None, [os.environ.get("PYTHONPATH")])]
    os.environ["PYTHONPATH"] = os.pathsep.join(path)
    sys.path[:0] = path[:2]
    results: dict[str, Any] = {"machine": machine(), "args": {k: str(v) for k, v in vars(a).items()},
                               "installed": installed, "cells": []}
    results.update(prepare(a, a.shapes))
    for shape in a.shapes:
        for cell in a.cells:
            print(f"[matrix] {shape} {cell} ...", flush=True)
            cell_result = run_cell(shape, cell, a, results)
            results["cells"].append(cell_result)
            tok = (cell_result.get("figures") or {}).get("tokens_per_s_per_gpu")
            print(f"[matrix] {shape} {cell}: rc={cell_result['rc']} tokens/s/GPU={tok}", flush=True)
            (a.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    results["table"] = table(results["cells"])
    (a.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(results["table"], flush=True)
    print(f"[matrix] wrote {a.out / 'results.json'} and {a.log}", flush=True)


if __name__ == "__main__":
    main()
