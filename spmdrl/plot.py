"""Pictures of runs: PNG figures drawn from the ``metrics.jsonl`` of one or more run folders.

    python -m spmdrl.plot outputs/spmdrl/grpo_tiny                   # -> outputs/spmdrl/grpo_tiny/plots/*.png
    python -m spmdrl.plot RUN_A RUN_B --out compare/                 # both runs on the same axes

Figures (each skipped when no run has its metrics):

- ``reward.png``: training reward (mean, with the min..max band for one run) and
  the validation score (every ``val-core/<source>/<var>/mean@k``);
- ``kl_entropy.png``: KL (actor KL loss, in-reward KL penalty, PPO's ratio KL)
  and the actor's entropy;
- ``length.png``: response length (mean, max) and the fraction of responses cut
  at ``data.max_response_length``;
- ``timing.png``: seconds per phase, stacked (one panel per run: stacks of
  several runs on one axis cannot be read);
- ``memory.png``: peak memory per phase (colour: phase, line style: run);
- ``throughput.png``: tokens/s and seconds per step;
- ``loss.png``: only for SFT runs (``spmdrl.sft``, which get it and ``throughput.png``): training and
  validation loss and the learning rate.

Runs overlay on the same axes with the run folder's name as the legend.
Training writes the same figures into ``{output_dir}/plots`` every
``trainer.plot_freq`` steps and at the end (rank 0; ``plot_run``).
matplotlib draws with the Agg backend: no display is needed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence

log = logging.getLogger("spmdrl")

FIGSIZE = (11.0, 4.2)  # inches; two panels side by side
DPI = 100
KL_KEYS = ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl")
PHASES = ("data", "offload", "weight_sync", "rollout", "reward", "sleep", "onload", "balance", "old_logp",
          "ref", "values", "adv", "update", "validation", "metrics", "log", "checkpoint", "plot", "other")
LINESTYLES = ("-", "--", ":", "-.")


class RunMetrics:
    """One run's metrics: a name and, per metric key, (steps, values) in step order."""

    def __init__(self, name: str, rows: list[dict]) -> None:
        self.name = name
        by_step: dict[int, dict] = {}
        for row in rows:  # a resumed run appends rows again from its checkpoint step: the later ones win
            by_step.setdefault(int(row["step"]), {}).update(row)
        self.rows = [by_step[s] for s in sorted(by_step)]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        pts = [(row["step"], float(row[key])) for row in self.rows if key in row and row[key] == row[key]]
        return [p[0] for p in pts], [p[1] for p in pts]

    def keys(self) -> set[str]:
        return {k for row in self.rows for k in row}


def read_run(run_dir: Path, name: Optional[str] = None) -> RunMetrics:
    """``run_dir/metrics.jsonl`` (a trainer.output_dir) as a ``RunMetrics``; lines that do not parse are
    skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl; give a trainer.output_dir of a run whose "
                                f"trainer.logger includes jsonl")
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line being written while we read
                continue
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
    return RunMetrics(name or Path(run_dir).resolve().name, rows)


def _names(run_dirs: Sequence[Path]) -> list[str]:
    """Folder names as legend labels; parent/name where two runs share a name."""
    names = [Path(d).resolve().name for d in run_dirs]
    return [f"{Path(d).resolve().parent.name}/{n}" if names.count(n) > 1 else n
            for d, n in zip(run_dirs, names)]


def _new_figure(title: str, panels: int = 2):
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only; never a display, also on a laptop with one
    import matplotlib.pyplot as plt

    width = FIGSIZE[0] * max(panels, 2) / 2  # one panel alone takes the full width
    fig, axes = plt.subplots(1, panels, figsize=(width, FIGSIZE[1]), squeeze=False)
    fig.suptitle(title)
    return fig, list(axes[0])


def _line(ax, run: RunMetrics, key: str, label: str, style: str = "-", color=None,
          marker: Optional[str] = None) -> bool:
    steps, values = run.series(key)
    if not steps:
        return False
    # A lone point (validation at one step) needs a marker to be seen at all.
    ax.plot(steps, values, style, color=color, marker=marker or ("o" if len(steps) == 1 else None),
            markersize=4, label=label)
    return True


def _finish(fig, axes, path: Path, drawn: bool) -> Optional[Path]:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    try:
        if not drawn:
            return None
        for ax in axes:
            if ax.has_data():
                ax.set_xlabel("step")
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
            else:
                ax.set_axis_off()
        fig.tight_layout()
        fig.savefig(path, dpi=DPI)
        return path
    finally:
        plt.close(fig)


def _label(runs: Sequence[RunMetrics], run: RunMetrics, what: str) -> str:
    return what if len(runs) == 1 else f"{run.name}: {what}"


def plot_reward(runs: Sequence[RunMetrics], path: Path) -> Optional[Path]:
    fig, (train, val) = _new_figure("reward")
    drawn = False
    for i, run in enumerate(runs):
        color = f"C{i}"
        drawn |= _line(train, run, "reward/mean", "reward/mean" if len(runs) == 1 else run.name, color=color)
        if len(runs) == 1:  # a band per run would hide the other runs' lines
            steps, lo = run.series("reward/min")
            _, hi = run.series("reward/max")
            if steps and len(lo) == len(hi):
                train.fill_between(steps, lo, hi, color=color, alpha=0.15, label="min..max")
        for j, key in enumerate(sorted(k for k in run.keys() if k.startswith("val-core/") and "/mean@" in k)):
            name = key[len("val-core/"):]
            drawn |= _line(val, run, key, _label(runs, run, name), LINESTYLES[j % len(LINESTYLES)], color,
                           "o")
    train.set_title("training reward")
    val.set_title("validation score (val-core mean@k)")
    return _finish(fig, (train, val), path, drawn)


def plot_kl_entropy(runs: Sequence[RunMetrics], path: Path) -> Optional[Path]:
    fig, (kl, ent) = _new_figure("KL and entropy")
    drawn = False
    for i, run in enumerate(runs):
        for j, key in enumerate(KL_KEYS):
            drawn |= _line(kl, run, key, _label(runs, run, key), LINESTYLES[j], f"C{i}")
        drawn |= _line(ent, run, "actor/entropy", run.name, color=f"C{i}")
    kl.set_title("KL")
    ent.set_title("actor entropy (nats / token)")
    return _finish(fig, (kl, ent), path, drawn)


def plot_length(runs: Sequence[RunMetrics], path: Path) -> Optional[Path]:
    fig, (length, clip) = _new_figure("response length")
    drawn = False
    for i, run in enumerate(runs):
        drawn |= _line(length, run, "response_length/mean", _label(runs, run, "mean"), "-", f"C{i}")
        drawn |= _line(length, run, "response_length/max", _label(runs, run, "max"), "--", f"C{i}")
        drawn |= _line(clip, run, "response_length/clip_ratio", run.name, color=f"C{i}")
    length.set_title("response length (tokens)")
    clip.set_title("clip ratio (cut at max_response_length)")
    return _finish(fig, (length, clip), path, drawn)


def _phases(run: RunMetrics, prefix: str, suffix: str) -> list[str]:
    """Phase names present in a run, the loop's order first, then any others alphabetically."""
    found = {k[len(prefix):-len(suffix) or None]
             for k in run.keys() if k.startswith(prefix) and k.endswith(suffix)}
    # not phases: the step itself, memory totals; a phase inside another (rollout/tools) is counted there
    found = {f for f in found if f not in ("step", "overall") and not f.startswith("rank") and "/" not in f}
    return [p for p in PHASES if p in found] + sorted(found - set(PHASES))


def plot_timing(runs: Sequence[RunMetrics], path: Path) -> Optional[Path]:
    fig, axes = _new_figure("seconds per phase (stacked)", panels=len(runs))
    drawn = False
    for ax, run in zip(axes, runs):
        steps = [row["step"] for row in run.rows if "timing/step" in row]
        rows = [row for row in run.rows if "timing/step" in row]
        phases = _phases(run, "timing/", "")
        if not steps or not phases:
            continue
        ax.stackplot(steps, [[row.get(f"timing/{p}", 0.0) for row in rows] for p in phases], labels=phases,
                     colors=[f"C{PHASES.index(p) if p in PHASES else 9}" for p in phases], alpha=0.85)
        ax.plot(steps, [row["timing/step"] for row in rows], "k--", linewidth=1, label="step")
        ax.set_title(f"{run.name}" if len(runs) > 1 else "seconds per phase")
        ax.set_ylabel("s")
        drawn = True
    return _finish(fig, axes, path, drawn)


def plot_memory(runs: Sequence[RunMetrics], path: Path) -> Optional[Path]:
    fig, (mem, overall) = _new_figure("peak memory per phase")
    drawn = False
    for i, run in enumerate(runs):
        style = LINESTYLES[i % len(LINESTYLES)]
        for p in _phases(run, "memory/", "_peak_gb"):
            color = f"C{PHASES.index(p) if p in PHASES else 9}"
            drawn |= _line(mem, run, f"memory/{p}_peak_gb", _label(runs, run, p), style, color)
        drawn |= _line(overall, run, "memory/overall_peak_gb", run.name, color=f"C{i}")
    mem.set_title("peak per phase (GB; CPU: process RSS)")
    overall.set_title("overall peak (GB, largest rank)")
    return _finish(fig, (mem, overall), path, drawn)


def plot_throughput(runs: Sequence[RunMetrics], path: Path) -> Optional[Path]:
    fig, (tps, step) = _new_figure("throughput")
    drawn = False
    for i, run in enumerate(runs):
        drawn |= _line(tps, run, "perf/tokens_per_s", run.name, color=f"C{i}")
        drawn |= _line(step, run, "timing/step", run.name, color=f"C{i}")
    tps.set_title("tokens / s (whole world)")
    step.set_title("seconds per step")
    return _finish(fig, (tps, step), path, drawn)


def plot_sft_loss(runs: Sequence[RunMetrics], path: Path) -> Optional[Path]:
    fig, (loss, lr) = _new_figure("SFT loss")
    drawn = False
    for i, run in enumerate(runs):
        drawn |= _line(loss, run, "train/loss", _label(runs, run, "train"), "-", f"C{i}")
        drawn |= _line(loss, run, "val/loss", _label(runs, run, "val"), "--", f"C{i}", "o")
        _line(lr, run, "train/lr", run.name, color=f"C{i}")
    loss.set_title("token-mean NLL of the targets (nats / token)")
    lr.set_title("learning rate")
    return _finish(fig, (loss, lr), path, drawn)


FIGURES = {
    "reward": plot_reward,
    "kl_entropy": plot_kl_entropy,
    "length": plot_length,
    "timing": plot_timing,
    "memory": plot_memory,
    "throughput": plot_throughput,
}
# An SFT run (spmdrl.sft) has no rollouts: its loss, and its speed.
SFT_FIGURES = {"loss": plot_sft_loss, "throughput": plot_throughput}


def plot_runs(run_dirs: Sequence[Path], out_dir: Path) -> list[Path]:
    """Every figure of ``FIGURES`` (``SFT_FIGURES`` when every run is an SFT run) for these runs into
    ``out_dir``; returns the PNGs written."""
    runs = [read_run(Path(d), name) for d, name in zip(run_dirs, _names(run_dirs))]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    # An SFT run: training loss, or only validation loss (trainer.val_only, or stopped before step 1).
    sft = all(({"train/loss", "val/loss"} & set(run.keys())) and "reward/mean" not in run.keys()
              for run in runs)
    for name, draw in (SFT_FIGURES if sft else FIGURES).items():
        png = draw(runs, out_dir / f"{name}.png")
        if png is not None:
            written.append(png)
    return written


def plot_run(out_dir: Path) -> list[Path]:
    """The training loop's hook (rank 0, trainer.plot_freq): figures of this run into ``out_dir/plots``.

    A failure is logged and swallowed: the figures are a view of metrics.jsonl, which is intact and can be
    plotted again with ``python -m spmdrl.plot``, while an exception here would end hours of training (and
    leave the other ranks waiting in their next collective, since only rank 0 plots).
    """
    try:
        return plot_runs([out_dir], Path(out_dir) / "plots")
    except Exception as err:
        log.warning("plotting %s failed (%s: %s); training goes on; run python -m spmdrl.plot %s to retry",
                    out_dir, type(err).__name__, err, out_dir)
        return []


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m spmdrl.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", type=Path,
                   help="run folders (trainer.output_dir) holding metrics.jsonl")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for the PNGs (default: RUN_DIR/plots for one run, ./plots for several)")
    args = p.parse_args(argv)
    out = args.out or (args.run_dirs[0] / "plots" if len(args.run_dirs) == 1 else Path("plots"))
    try:
        written = plot_runs(args.run_dirs, out)
    except FileNotFoundError as err:
        print(f"spmdrl.plot: error: {err}", file=sys.stderr)
        sys.exit(2)
    if not written:
        print(f"spmdrl.plot: error: no metric to plot in {', '.join(map(str, args.run_dirs))}",
              file=sys.stderr)
        sys.exit(2)
    for png in written:
        print(png)


if __name__ == "__main__":
    main()
