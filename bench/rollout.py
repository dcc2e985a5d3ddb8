"""Rollout throughput: the native engine against transformers generate, vLLM and SGLang (CPU), one table.

    python bench/rollout.py                                  # the full grid (long on 2 cores)
    python bench/rollout.py --models small --batch 64 128 --n 1 --new-tokens 64 --repeats 5 --dtype bf16 fp32
    python bench/rollout.py --models tiny --batch 32 --n 1 --new-tokens 64 --dtype fp32 \\
        --vllm-python .venv-vllm/bin/python                  # adds the vllm rows, run with that venv's python

With ``--vllm-python`` three rows are added: ``vllm`` is spmdrl's engine (``rollout.engine: vllm``:
the external launcher in a world of one, one seed per call, processed log-probs, the output tensors the
loop trains on), ``vllm-raw`` is vLLM's ``LLM.generate`` alone without log-probs and ``vllm-raw-lp`` the
same asking for the sampled token's log-prob (``logprobs=0``), the job spmdrl's engine does; ``vllm-nolp``
is spmdrl's engine told to skip them (``rollout.calculate_log_probs: false``). "x raw" is a row's rate over
``vllm-raw``'s, "x lp" over ``vllm-raw-lp``'s: the first is what log-probs and the wrapper cost together,
the second the wrapper alone. ``vllm-keyed`` (and ``native-keyed`` / ``hf-keyed`` in ``--engines``) draws
as a training step does with ``rollout.seed_mode: per_response``: every response from its own key
(``SamplingParams.keys``; vLLM: one seeded request per response), against the rows' one stream per
call. Every vllm row runs with ``--vllm-eager`` (default off:
vLLM's own default, compiled with torch.compile, as production runs set ``rollout.enforce_eager: false``).
``--sglang-python .venv-sglang/bin/python`` adds ``sglang`` (``rollout.engine: sglang``: each prompt
submitted n times, log-probs, the output tensors), ``sglang-nolp``, ``sglang-raw`` (``sglang.Engine.generate``
with ``n``, no log-probs) and ``sglang-raw-lp`` (with ``return_logprob``) the same way; their RSS adds the
engine's scheduler and detokenizer processes.

Each (model, dtype, engine) runs in its own subprocess, so peak RSS is that
engine's alone (VmHWM, reset before each cell). Per cell: warm-up runs, then
``--repeats`` timed ``generate`` calls; with ``--rounds R`` the whole sequence of
engines runs R times in turn and every figure is the median over the R x repeats
calls, so drift on a shared machine hits every engine alike (the GEMM rate below
is sampled in every round as well). tok/s counts
generated tokens (response mask); TTFT is the median wall time of the same call
with max_tokens=1 (prefill of the whole batch plus one sampled token). Sampling
is temperature 1 with EOS active, on random-token prompts of ``--prompt-len``.

"limit" is the GEMM-bound rate: matmul FLOP/s in the row's dtype (so float32
rows are not divided by an emulated bf16 rate on a CPU without native bf16),
measured in this run on the model's own decode-shaped matmuls (rows = sequences decoded at once, weights of
every layer so they stream from memory as in decode) divided by 2 x parameters
FLOP per generated token. "%lim" = tok/s / limit; "x hf" = tok/s / hf's tok/s for
the same model, dtype and cell; measured in the same run. The table also prints
the load average, because other jobs on a shared machine slow every engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


# ---- worker side: runs in a subprocess (for vllm, under another venv's python) -------------------

def _reset_peak_rss(pids: list = ()) -> None:
    """Writing 5 to clear_refs resets VmHWM (Linux >= 4.0), so each cell gets its own peak; ``pids``: the
    engine's child processes (SGLang's scheduler holds the model), reset alike."""
    for pid in ["self", *pids]:
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            pass


def _peak_rss_mb(pids: list = ()) -> float:
    """Peak RSS of this process plus ``pids`` (summed: they run side by side)."""
    total = 0.0
    for pid in ["self", *pids]:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) / 1024
    return total


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


class _SpmdrlRunner:
    """native, hf, vllm or sglang through spmdrl's build_rollout."""

    def __init__(self, engine: str, path: str, dtype: str, max_num_seqs: int, seed: int, max_model_len: int,
                 eager: bool):
        sys.path.insert(0, str(REPO))
        import torch

        from spmdrl.rollout import build_rollout
        from spmdrl.rollout.base import SamplingParams

        self.SamplingParams, self.logprobs = SamplingParams, not engine.endswith("-nolp")
        self.keyed = engine.endswith("-keyed")  # keyed sampling, as a training step runs it
        engine = engine.removesuffix("-nolp").removesuffix("-keyed")
        extra = {}
        if engine == "vllm":  # the external launcher needs a process group: a world of one
            from spmdrl.parallel import init_distributed

            init_distributed("cpu")
            # as rollout.calculate_log_probs does: without log-probs, vLLM's raw mode
            extra = dict(max_model_len=max_model_len, enforce_eager=eager, logprobs=self.logprobs)
        if engine == "sglang":
            extra = dict(max_model_len=max_model_len)
        self.engine = build_rollout(engine, path, dtype=getattr(torch, dtype), max_num_seqs=max_num_seqs,
                                    seed=seed, **extra)

    def child_pids(self) -> list[int]:
        return self.engine.engine.get_all_child_pids() if hasattr(self.engine, "engine") else []

    def run(self, prompts: list[list[int]], n: int, max_tokens: int) -> int:
        from spmdrl.rollout.sampling import response_key

        keys = tuple(response_key(0, 0, 1, i) for i in range(len(prompts))) if self.keyed else None
        out = self.engine.generate(prompts, self.SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0,
                                                                logprobs=self.logprobs, keys=keys))
        return int(out.response_mask.sum())


class _VllmRunner:
    """vLLM's LLM class in this process (V1 multiprocessing off, so RSS and timing are this process's)."""

    def __init__(self, path: str, dtype: str, max_num_seqs: int, seed: int, max_model_len: int, eager: bool,
                 logprobs: bool):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # vLLM preallocates this many GiB of KV cache up front (it counts in its RSS); 1 GiB holds
        # every cell of the default grid.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM, SamplingParams

        self.SamplingParams, self.logprobs = SamplingParams, logprobs
        self.llm = LLM(model=path, dtype=dtype, seed=seed, max_num_seqs=max_num_seqs,
                       max_model_len=max_model_len, disable_log_stats=True, enforce_eager=eager,
                       **(dict(logprobs_mode="processed_logprobs") if logprobs else {}))

    def child_pids(self) -> list[int]:
        return []

    def run(self, prompts: list[list[int]], n: int, max_tokens: int) -> int:
        sp = self.SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, top_p=1.0, detokenize=False,
                                 **(dict(logprobs=0, flat_logprobs=True) if self.logprobs else {}))
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)


class _SglangRunner:
    """``sglang.Engine`` alone, with the CPU settings spmdrl's engine uses (scheduler in a child process,
    asleep when idle)."""

    def __init__(self, path: str, dtype: str, max_num_seqs: int, seed: int, max_model_len: int,
                 logprobs: bool):
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # read when SGLang's modules are imported
        import sglang

        self.logprobs = logprobs
        self.engine = sglang.Engine(
            model_path=path, dtype=dtype, device="cpu", random_seed=seed, skip_tokenizer_init=True,
            attention_backend="torch_native", sampling_backend="pytorch", disable_cuda_graph=True,
            context_length=max_model_len, max_running_requests=max_num_seqs,
            max_total_tokens=max_num_seqs * max_model_len, sleep_on_idle=True)

    def child_pids(self) -> list[int]:
        return self.engine.get_all_child_pids()

    def run(self, prompts: list[list[int]], n: int, max_tokens: int) -> int:
        outs = self.engine.generate(input_ids=prompts, return_logprob=self.logprobs, sampling_params=dict(
            n=n, max_new_tokens=max_tokens, temperature=1.0))
        return sum(len(o["output_ids"]) for o in outs)


def worker(spec: dict) -> None:
    """Run every cell of ``spec`` with one engine instance; print one JSON line per cell."""
    if spec.get("threads"):
        import torch

        torch.set_num_threads(spec["threads"])
    max_len = spec["prompt_len"] + max(c["new_tokens"] for c in spec["cells"])
    common = (spec["path"], spec["dtype"], spec["max_num_seqs"], 0, max_len)
    lp = spec["engine"].endswith("-lp")
    if spec["engine"].startswith("vllm-raw"):
        runner = _VllmRunner(*common, eager=spec["vllm_eager"], logprobs=lp)
    elif spec["engine"].startswith("sglang-raw"):
        runner = _SglangRunner(*common, logprobs=lp)
    else:
        runner = _SpmdrlRunner(spec["engine"], *common, eager=spec["vllm_eager"])
    for cell in spec["cells"]:
        prompts = _prompts(cell["batch"], spec["prompt_len"], spec["vocab"], seed=cell["batch"])
        _reset_peak_rss(runner.child_pids())
        for _ in range(spec["warmup"]):
            runner.run(prompts, cell["n"], cell["new_tokens"])
        rates, ttft = [], []
        for _ in range(spec["repeats"]):
            t = time.perf_counter()
            tokens = runner.run(prompts, cell["n"], cell["new_tokens"])
            rates.append(tokens / (time.perf_counter() - t))
        for _ in range(spec["repeats"]):
            t = time.perf_counter()
            runner.run(prompts, cell["n"], 1)
            ttft.append(time.perf_counter() - t)
        rss = _peak_rss_mb(runner.child_pids())
        print(json.dumps({**cell, "rates": rates, "ttfts": ttft, "rss_mb": rss}), flush=True)
    if spec["engine"].startswith("sglang-raw"):
        runner.engine.shutdown()
    elif spec["engine"].startswith("sglang"):
        runner.engine.close()  # stops the engine's scheduler and detokenizer


# ---- driver side ---------------------------------------------------------------------------------

def gemm_times(config_path: Path, rows: int, repeats: int, dtype: str) -> tuple[int, list[float]]:
    """FLOP of one pass over this model's decode matmuls with ``rows`` rows in ``dtype`` (a torch dtype
    name), and ``repeats`` timed passes."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(REPO))
    from spmdrl.rollout.native.config import DecoderConfig

    c = DecoderConfig.from_folder(config_path)
    h, d, i = c.hidden_size, c.head_dim, c.intermediate_size
    shapes = [(h, (c.num_heads + 2 * c.num_kv_heads) * d), (c.num_heads * d, h), (h, 2 * i), (i, h)]
    g = torch.Generator().manual_seed(0)
    bf = getattr(torch, dtype)
    layers = [[torch.randn(o, k, generator=g).to(bf) for k, o in shapes] for _ in range(c.num_layers)]
    head = torch.randn(c.vocab_size, h, generator=g).to(bf)
    xs = {k: torch.randn(rows, k, generator=g).to(bf) for k in {h, c.num_heads * d, i}}
    flop = 2 * rows * (sum(k * o for k, o in shapes) * c.num_layers + h * c.vocab_size)
    times = []
    with torch.inference_mode():
        for r in range(repeats + 2):
            t = time.perf_counter()
            for ws in layers:
                for (k, _), w in zip(shapes, ws):
                    F.linear(xs[k], w)
            F.linear(xs[h], head)
            if r >= 2:  # two warm-up passes
                times.append(time.perf_counter() - t)
    return flop, times


def gemm_limit(config_path: Path, flop: int, times: list[float]) -> tuple[float, float]:
    """(GFLOP/s, GEMM-bound tok/s) from the median of the timed passes."""
    sys.path.insert(0, str(REPO))
    from spmdrl.rollout.native.config import DecoderConfig

    rate = flop / statistics.median(times)
    return rate / 1e9, rate / (2 * DecoderConfig.from_folder(config_path).num_params())


def run_worker(python: str, spec: dict, env: dict) -> list[dict]:
    cmd = [python, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        print(f"# {spec['engine']} on {spec['model']} {spec['dtype']} failed "
              f"(exit {proc.returncode}):\n{tail}", file=sys.stderr)
    return rows


def build_models(models: list[str]) -> dict[str, Path]:
    sys.path.insert(0, str(REPO))
    from spmdrl.builtin.models import resolve_builtin_model

    return {m: Path(resolve_builtin_model(f"builtin:{m}")) for m in models}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    p.add_argument("--batch", nargs="+", type=int, default=[32, 128], help="prompts per generate call")
    p.add_argument("--n", nargs="+", type=int, default=[1, 8], help="samples per prompt")
    p.add_argument("--new-tokens", nargs="+", type=int, default=[64, 256])
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    p.add_argument("--engines", nargs="+", default=["native", "hf"],
                   choices=["native", "hf", "native-keyed", "hf-keyed"])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per figure (the median is printed)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1,
                   help="times every engine runs its cells, interleaved; figures are medians over all runs")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="rows decoded at once (engines chunk above it)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per engine process and OMP_NUM_THREADS for vllm (0: their defaults)")
    p.add_argument("--vllm-python", default=None,
                   help="python of a venv with vllm (.venv-vllm/bin/python): adds the vllm and vllm-raw rows")
    p.add_argument("--vllm-eager", choices=["on", "off"], default="off",
                   help="enforce_eager of every vllm row (off: compiled, vLLM's default)")
    p.add_argument("--sglang-python", default=None,
                   help="python of .venv-sglang (.ci/sglang-venv): adds the sglang and sglang-raw rows")
    p.add_argument("--only", nargs="+", default=None, help="run only these rows (engine names as printed)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))

    paths = build_models(args.models)
    cells = [dict(batch=b, n=n, new_tokens=t) for b in args.batch for n in args.n for t in args.new_tokens]
    engines = [(e, sys.executable) for e in args.engines]
    if args.vllm_python:
        engines += [(e, args.vllm_python)
                    for e in ("vllm", "vllm-keyed", "vllm-nolp", "vllm-raw", "vllm-raw-lp")]
    if args.sglang_python:
        engines += [(e, args.sglang_python) for e in ("sglang", "sglang-nolp", "sglang-raw", "sglang-raw-lp")]
    if args.only:  # e.g. --only native native-keyed vllm vllm-keyed: the seed_mode comparison alone
        engines = [(e, py) for e, py in engines if e in args.only]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    if args.threads:  # vLLM reads its thread count from the environment
        env["OMP_NUM_THREADS"] = str(args.threads)
    load0 = os.getloadavg()
    pooled: dict[tuple, dict] = {}
    gemm: dict[tuple, tuple[int, list[float]]] = {}
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)  # the GEMM rate is measured with the engines' thread count
    # Rounds run every engine in turn, so a slow spell of a shared machine lands on all of them.
    for rnd in range(args.rounds):
        for model, path in paths.items():
            vocab = json.loads((path / "config.json").read_text())["vocab_size"]
            for dt in args.dtype:
                for engine, python in engines:
                    spec = dict(engine=engine, model=model, path=str(path), dtype=DTYPES[dt], cells=cells,
                                prompt_len=args.prompt_len, vocab=vocab, repeats=args.repeats,
                                warmup=args.warmup, max_num_seqs=args.max_num_seqs, threads=args.threads,
                                vllm_eager=args.vllm_eager == "on")
                    print(f"# round {rnd + 1}/{args.rounds}: {engine} on {model} {dt} ({len(cells)} cells)",
                          file=sys.stderr, flush=True)
                    for r in run_worker(python, spec, env):
                        acc = pooled.setdefault((model, dt, r["batch"], r["n"], r["new_tokens"], engine),
                                                {"rates": [], "ttfts": [], "rss_mb": 0.0})
                        acc["rates"] += r["rates"]
                        acc["ttfts"] += r["ttfts"]
                        acc["rss_mb"] = max(acc["rss_mb"], r["rss_mb"])
            # The GEMM rate is sampled in every round too, so it sees the same spells as the engines,
            # in each measured dtype: the limit of a float32 row is the float32 matmul rate.
            for dt in args.dtype:
                for rows in sorted({min(c["batch"] * c["n"], args.max_num_seqs) for c in cells}):
                    flop, times = gemm_times(path, rows, repeats=max(5, args.repeats), dtype=DTYPES[dt])
                    gemm.setdefault((model, dt, rows), (flop, []))[1].extend(times)
    results = {k: {"tok_s": statistics.median(v["rates"]), "ttft_ms": 1e3 * statistics.median(v["ttfts"]),
                   "rss_mb": v["rss_mb"]} for k, v in pooled.items()}
    limits = {key: gemm_limit(paths[key[0]], flop, times) for key, (flop, times) in gemm.items()}
    print_table(args, paths, cells, [e for e, _ in engines], results, limits, load0)


def print_table(args, paths, cells, engines, results, limits, load0) -> None:
    import torch

    load1 = os.getloadavg()
    threads = args.threads or f"{torch.get_num_threads()} (vllm: its own default)"
    print(f"\nrollout benchmark: torch {torch.__version__}, {os.cpu_count()} cores, threads {threads}, "
          f"prompt {args.prompt_len} tokens, temperature 1, median of {args.rounds} x {args.repeats} runs "
          f"(each after {args.warmup} warm-up), max_num_seqs {args.max_num_seqs}; load average "
          f"{load0[0]:.1f} at start, {load1[0]:.1f} at end")
    hdr = (f"{'model':<6} {'dtype':<5} {'batch':>5} {'n':>2} {'new':>4} {'engine':<13} {'tok/s':>8} "
           f"{'TTFT ms':>8} {'RSS MB':>7} {'limit':>7} {'%lim':>5} {'x hf':>5} {'x vllm':>6} {'x raw':>5}"
           f" {'x lp':>5}  GFLOP/s")
    print(hdr)
    print("-" * len(hdr))

    def ratio(r: dict, base: dict | None, width: int) -> str:
        return f"{r['tok_s'] / base['tok_s']:{width}.2f}" if base else " " * (width - 1) + "-"

    for model in paths:
        for dt in args.dtype:
            for c in cells:
                rows = min(c["batch"] * c["n"], args.max_num_seqs)
                gflops, limit = limits[(model, dt, rows)]  # the matmul rate of this row's dtype
                key = (model, dt, c["batch"], c["n"], c["new_tokens"])
                hf, vllm = results.get(key + ("hf",)), results.get(key + ("vllm",))
                for e in engines:
                    r = results.get(key + (e,))
                    if r is None:
                        continue
                    # spmdrl's wrapper against its library alone, without and with log-probs
                    lib = e.split("-")[0]
                    raw = results.get(key + (f"{lib}-raw",)) if not e.startswith(f"{lib}-raw") else None
                    lp = results.get(key + (f"{lib}-raw-lp",)) if e == lib else None
                    print(f"{model:<6} {dt:<5} {c['batch']:>5} {c['n']:>2} {c['new_tokens']:>4} {e:<13} "
                          f"{r['tok_s']:>8.0f} {r['ttft_ms']:>8.1f} {r['rss_mb']:>7.0f} {limit:>7.0f} "
                          f"{100 * r['tok_s'] / limit:>4.0f}% {ratio(r, hf, 5)} {ratio(r, vllm, 6)} "
                          f"{ratio(r, raw, 5)} {ratio(r, lp, 5)}  {gflops:.0f}")


if __name__ == "__main__":
    main()
