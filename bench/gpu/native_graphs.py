"""The native engine's decode with CUDA graphs off and on: decode tokens/s, whether both sample the same
tokens, and whether weights pushed after the capture reach the graphs.

    python3 bench/gpu/native_graphs.py --model builtin:qwen2.5-0.5b-shape
    python3 bench/gpu/native_graphs.py --device cpu --model builtin:tiny --prompts 2 --n 2 --new-tokens 8

Run from the repository root (the checkout is put on sys.path). A ``builtin:`` model is its config.json
with seeded random weights streamed into the engines by ``update_weights`` (nothing built or read from
disk, so a run takes seconds); any other path is a Hugging Face folder. The final norm's weight is 10,
not 1, so the logits spread over ~6 nats and the next-token distribution is peaked as a trained model's
is: "the same tokens" is then a meaningful comparison (a flat one flips tokens on rounding noise).

Three parts, each engine built twice (graphs off: the eager loop; graphs on: graphs.py):

1. speed: ``--prompts`` x ``--n`` rows, exactly ``--new-tokens`` tokens (ignore_eos), keyed uniforms, in
   ``--dtype``; one warm-up call (it captures the graphs), then the median of ``--repeats`` calls;
   agreement: the fraction of equal tokens, and the largest |log-prob difference| over the first 16
   positions of each row before its first differing token;
2. weight update: greedy on the graphs engine (capturing its graphs), then both engines get perturbed
   weights (final norm rescaled per channel, layer 0's MLP output x3); the graphs engine must replay the
   graphs it has (no new capture) and decode what the eager engine decodes;
3. stops: float32, stop ids that end rows at different steps, so buckets shrink and rows move; the graphs
   must reproduce the same fixed-shape loop run eagerly (no capture) exactly, and agree with the eager
   loop up to rounding: its matmuls run at other batch sizes (rows leave at once, not by bucket), and a
   rounding-level change of a logit moves a token whose uniform falls next to a CDF step.

Prints one JSON line, then a table. On CPU the "graphs" engine runs the same fixed-shape loop eagerly
(no capture): a smoke test of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable from a checkout

from spmdrl.rollout.base import GenerationOutput, SamplingParams  # noqa: E402
from spmdrl.rollout.native.config import DecoderConfig  # noqa: E402
from spmdrl.rollout.native.engine import NativeRollout  # noqa: E402
from spmdrl.rollout.native.model import Decoder  # noqa: E402
from spmdrl.rollout.sampling import response_key  # noqa: E402

Stream = Callable[[], Iterator[tuple[str, torch.Tensor]]]


def model_folder(model: str, out: Path) -> tuple[str, bool]:
    """(folder, random weights): a builtin model's config.json alone, or the folder given."""
    if not model.startswith("builtin:"):
        return model, False
    from spmdrl.builtin.models import builtin_config

    (out / "config.json").write_text(json.dumps(builtin_config(model)))
    return str(out), True


def random_weights(folder: str, seed: int, device: torch.device) -> Stream:
    """A seeded stream of every weight the folder's config names: N(0, 0.02), norms 1 (the final one 10)."""
    skeleton = Decoder(DecoderConfig.from_folder(folder), "cpu", torch.bfloat16).weights  # never touched
    shapes = {name: tuple(t.shape) for name, t in skeleton.slots.items() if name not in skeleton.optional}
    del skeleton

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        g = torch.Generator(device).manual_seed(seed)
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                yield name, torch.full(shape, 10.0 if name == "model.norm.weight" else 1.0, device=device)
            else:
                yield name, torch.randn(shape, generator=g, device=device) * 0.02
    return stream


def perturbed(base: Stream, seed: int) -> Stream:
    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in base():
            if name == "model.norm.weight":
                g = torch.Generator(t.device).manual_seed(seed)
                t = t * (0.25 + 1.5 * torch.rand(t.shape, generator=g, device=t.device))
            elif name == "model.layers.0.mlp.down_proj.weight":
                t = t * 3
            yield name, t
    return stream


def build(folder: str, weights: Stream | None, graphs: bool, device: torch.device, dtype: str, rows: int,
          capture: bool = True) -> NativeRollout:
    """graphs: the fixed-shape loop, captured when ``capture`` and on CUDA, else run eagerly."""
    cuda = device.type == "cuda"
    eng = NativeRollout(folder, device=device, dtype=dtype, max_num_seqs=rows, eos_token_ids=[2],
                        pad_token_id=0, load_weights=weights is None,
                        cuda_graphs="on" if graphs and cuda and capture else "off")
    eng.static_decode = graphs
    if weights is not None:
        eng.update_weights(weights())
    return eng


def timed(eng: NativeRollout, prompts: list[list[int]], sp: SamplingParams, repeats: int
          ) -> tuple[GenerationOutput, float, list[float]]:
    """(last output, warm-up seconds, timed seconds)."""
    start = time.perf_counter()
    eng.generate(prompts, sp)
    warm = time.perf_counter() - start
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = eng.generate(prompts, sp)
        seconds.append(time.perf_counter() - start)
    return out, warm, seconds


def agreement(a: GenerationOutput, b: GenerationOutput, first: int = 16) -> dict:
    """Equal tokens overall; per row the first differing position; the largest |log-prob diff| over the
    first ``first`` positions before it (the same context on both sides)."""
    same = a.response_ids == b.response_ids  # [N, R]
    R = same.shape[1]
    diverge = torch.where(same.all(-1), R, (~same).int().argmax(-1))  # [N]
    cols = torch.arange(R)[None, :]
    ctx = (cols < diverge[:, None]) & (cols < first) & a.response_mask & b.response_mask
    lp = (a.logprobs - b.logprobs).abs()[ctx]
    return {"tokens_equal": round(float(same.float().mean()), 4),
            "first_diff_median": float(diverge.float().median()),
            f"tokens_equal_first{first}": round(float(same[:, :first].float().mean()), 4),
            f"max_logprob_diff_first{first}": float(lp.max()) if lp.numel() else 0.0}


def num_graphs(eng: NativeRollout) -> int:
    return eng._static.num_graphs if eng._static is not None else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:qwen2.5-0.5b-shape")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = a.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    rows = a.prompts * a.n
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder, rand = model_folder(a.model, Path(tmp))
        cfg = json.loads((Path(folder) / "config.json").read_text())
        base = random_weights(folder, a.seed, device) if rand else (lambda: Decoder.iter_checkpoint(folder))
        vocab = min(cfg["vocab_size"], 2048)  # ids a built-in tokenizer has
        rng = random.Random(a.seed)
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(24, 64))] for _ in range(a.prompts)]
        keys = tuple(response_key(a.seed, 0, 0, i) for i in range(a.prompts))
        sp = SamplingParams(n=a.n, max_tokens=a.new_tokens, temperature=1.0, ignore_eos=True, keys=keys)
        result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        "torch": torch.__version__, "model": a.model, "dtype": dtype, "rows": rows,
                        "new_tokens": a.new_tokens}

        # 1. speed and agreement
        engines, outs = {}, {}
        for graphs in (False, True):
            name = "graphs" if graphs else "eager"
            engines[name] = eng = build(folder, base if rand else None, graphs, device, dtype, rows)
            outs[name], warm, seconds = timed(eng, prompts, sp, a.repeats)
            s = statistics.median(seconds)
            result[name] = {"generate_s": round(s, 4), "warmup_s": round(warm, 3),
                            "ms_per_step": round(1000 * s / a.new_tokens, 3),
                            "decode_tokens_per_s": round(rows * a.new_tokens / s, 1),
                            "graphs": num_graphs(eng)}
        result["speedup"] = round(result["eager"]["generate_s"] / result["graphs"]["generate_s"], 2)
        result["agreement"] = agreement(outs["eager"], outs["graphs"])

        # 2. weights pushed after the capture reach the graphs
        greedy = SamplingParams(n=1, max_tokens=min(a.new_tokens, 32), temperature=0.0, ignore_eos=True)
        g, e = engines["graphs"], engines["eager"]
        before = g.generate(prompts, greedy)
        held, captured = g._static, num_graphs(g)
        new = perturbed(base, a.seed + 1)
        for eng in (g, e):
            eng.update_weights(new())
        after_g, after_e = g.generate(prompts, greedy), e.generate(prompts, greedy)
        changed = (after_g.response_ids != before.response_ids).float().mean()
        result["weight_update"] = {**agreement(after_e, after_g),
                                   "same_graphs_replayed": g._static is held and num_graphs(g) == captured,
                                   "tokens_changed_by_update": round(float(changed), 4)}
        del engines, g, e, outs

        # 3. float32 with stop ids: buckets shrink, rows move
        stops = list(range(3, cfg["vocab_size"], 29))
        srows = min(a.prompts, 8) * min(a.n, 4)
        ssp = SamplingParams(n=min(a.n, 4), max_tokens=min(a.new_tokens, 64), temperature=1.0,
                             stop_token_ids=stops, keys=keys[:min(a.prompts, 8)])
        fp32: dict = {}
        for name, static, capture in (("eager", False, False), ("static", True, False),
                                      ("graphs", True, True)):
            eng = build(folder, base if rand else None, static, device, "float32", srows, capture)
            fp32[name] = eng.generate(prompts[:min(a.prompts, 8)], ssp)
            fp32["captured"] = num_graphs(eng)
            del eng
        se, ss, sg = fp32["eager"], fp32["static"], fp32["graphs"]
        lengths = se.response_lengths.float()
        result["stops_fp32"] = {
            "graphs_equal_uncaptured": torch.equal(ss.response_ids, sg.response_ids)
            and torch.equal(ss.logprobs, sg.logprobs) and ss.finish_reasons == sg.finish_reasons,
            **agreement(se, sg), "lengths_equal": torch.equal(se.response_lengths, sg.response_lengths),
            "length_min_mean_max": [int(lengths.min()), round(float(lengths.mean()), 1), int(lengths.max())],
            "graphs": fp32["captured"]}
    result["total_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result), flush=True)

    w, s = result["weight_update"], result["stops_fp32"]
    print(f"\n{'':22}{'eager':>12}{'graphs':>12}")
    for key in ("decode_tokens_per_s", "ms_per_step", "generate_s", "warmup_s", "graphs"):
        print(f"{key:22}{result['eager'][key]:>12}{result['graphs'][key]:>12}")
    print(f"speedup {result['speedup']}x; {dtype} tokens equal {result['agreement']['tokens_equal']:.2%} "
          f"(max |logprob diff| first 16: {result['agreement']['max_logprob_diff_first16']:.2e})")
    print(f"weight update: same graphs replayed {w['same_graphs_replayed']}, greedy tokens equal to eager "
          f"(first 16) {w['tokens_equal_first16']:.2%}, changed by the update "
          f"{w['tokens_changed_by_update']:.2%}")
    print(f"float32 with stops: graphs = uncaptured fixed-shape loop {s['graphs_equal_uncaptured']}; against "
          f"eager: tokens equal {s['tokens_equal']:.2%}, lengths equal {s['lengths_equal']}; lengths "
          f"{s['length_min_mean_max']}, {s['graphs']} graphs; total {result['total_s']} s")


if __name__ == "__main__":
    main()
