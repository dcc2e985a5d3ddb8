"""The native engine's fixed-shape decode loop (graphs.py, what CUDA graphs replay) against its dynamic loop,
run eagerly on CPU; its bucket and width choice; and the rollout.native_cuda_graphs key.

    pytest tests/unit/test_native_graphs.py

The CUDA capture itself needs a GPU: bench/gpu/native_graphs.py runs it there.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from spmdrl.rollout.base import SamplingParams
from spmdrl.rollout.native import graphs
from spmdrl.rollout.native.engine import NativeRollout
from spmdrl.rollout.native.graphs import bucket_rows, graph_width, resolve_cuda_graphs
from spmdrl.rollout.sampling import response_key

EOS, PAD = 2, 0
STOPS = list(range(3, 2048, 29))  # about 3% of the vocabulary: rows stop at many different steps


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 2048, (n,), generator=g).tolist() for n in lengths]


def _pair(path: Path, **kw) -> tuple[NativeRollout, NativeRollout]:
    """The same engine twice, the second on the fixed-shape loop (both on torch ops, so only the loop
    differs)."""
    make = lambda: NativeRollout(str(path), pad_token_id=PAD, eos_token_ids=[EOS], kernels="off", **kw)  # noqa: E731
    dynamic, static = make(), make()
    static.static_decode = True
    return dynamic, static


@pytest.fixture
def buckets(monkeypatch) -> list[int]:
    """The bucket of every fixed-shape step, in order."""
    seen: list[int] = []
    step = graphs.StaticDecode.step

    def record(self, kv, rows, *args):
        seen.append(rows)
        return step(self, kv, rows, *args)

    monkeypatch.setattr(graphs.StaticDecode, "step", record)
    return seen


def _assert_same(a, b) -> None:
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask) and a.finish_reasons == b.finish_reasons
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("sampling", [
    SamplingParams(n=3, max_tokens=40, temperature=0.8, stop_token_ids=STOPS),
    SamplingParams(n=3, max_tokens=40, temperature=1.0, top_k=50, top_p=0.9, stop_token_ids=STOPS),
    SamplingParams(n=3, max_tokens=40, temperature=0.0, stop_token_ids=STOPS[::4]),
], ids=["keyed", "keyed-truncated", "greedy"])
def test_fixed_shape_loop_samples_what_the_dynamic_one_does(tiny_model_dir, buckets, sampling):
    """Rows stop at different steps, so the fixed-shape loop masks finished rows, shrinks its bucket (rows
    move) and stops early, while the dynamic loop compacts every step and widens its view: the same tokens,
    log-probs and finish reasons, row by row."""
    keys = tuple(response_key(1, 0, 3, i) for i in range(5))
    sp = sampling if sampling.greedy else replace(sampling, keys=keys)
    dynamic, static = _pair(tiny_model_dir, seed=3)
    prompts = _prompts([6, 2, 10, 4, 7], seed=5)
    a, b = dynamic.generate(prompts, sp), static.generate(prompts, sp)
    _assert_same(a, b)
    lengths = a.response_lengths
    assert lengths.min() < 20 and "length" in a.finish_reasons  # early stops and full rows
    # 15 rows start in a bucket of 15 (the cache's rows); it shrinks as rows stop, and the loop ends
    # before max_tokens once no row is left.
    assert buckets[0] == 15 and len(set(buckets)) > 1 and buckets == sorted(buckets, reverse=True)


def test_fixed_shape_loop_in_chunks_with_padding_rows(tiny_model_dir, buckets):
    """A chunk of fewer rows than the cache (5 prompts x 5 in chunks of 10, 10 and 5 rows) runs in a bucket
    with a padding row (6); ignore_eos means no row stops and the loop never checks."""
    keys = tuple(response_key(2, 0, 1, i) for i in range(5))
    sp = SamplingParams(n=5, max_tokens=24, temperature=1.0, ignore_eos=True, keys=keys)
    dynamic, static = _pair(tiny_model_dir, max_num_seqs=10)
    prompts = _prompts([3, 12, 5, 8, 1], seed=6)
    _assert_same(dynamic.generate(prompts, sp), static.generate(prompts, sp))
    assert buckets == [10] * 23 + [10] * 23 + [6] * 23


def test_fixed_shape_loop_keeps_prefixes_for_the_next_turn(tiny_model_dir):
    """keep_prefix (multi-turn): rows found finished steps late keep the K/V up to their stop only, so the
    next call continues them from the cache exactly as after the dynamic loop."""
    sp = SamplingParams(n=1, max_tokens=32, stop_token_ids=STOPS, keep_prefix=True,
                        keys=tuple(response_key(3, 0, 2, i) for i in range(4)))
    dynamic, static = _pair(tiny_model_dir)
    prompts = _prompts([5, 9, 3, 7], seed=8)
    first = [e.generate(prompts, sp) for e in (dynamic, static)]
    _assert_same(*first)
    assert dynamic._prefixes.keys() == static._prefixes.keys() and len(static._prefixes) >= 2
    for k, (kd, vd) in dynamic._prefixes.items():
        torch.testing.assert_close(static._prefixes[k][0], kd, atol=1e-5, rtol=0)
        torch.testing.assert_close(static._prefixes[k][1], vd, atol=1e-5, rtol=0)
    out = first[0]
    turn = [p + out.response_ids[i, :int(out.response_lengths[i])].tolist() + [7, 11, 13]
            for i, p in enumerate(prompts) if out.finish_reasons[i] == "stop"]
    before = [e.prefill_tokens for e in (dynamic, static)]
    second = [e.generate(turn, replace(sp, keys=sp.keys[:len(turn)])) for e in (dynamic, static)]
    _assert_same(*second)
    assert dynamic.prefill_tokens - before[0] == static.prefill_tokens - before[1] < len(turn) * 5


def test_fixed_shape_loop_with_the_engine_generator(tiny_model_dir):
    """Without keys the uniforms come from the engine's generator (drawn for a whole bucket, so not the
    dynamic loop's samples): seeded calls repeat, other seeds differ, log-probs are the sampled tokens'."""
    _, static = _pair(tiny_model_dir)
    prompts = _prompts([4, 8], seed=9)
    sp = SamplingParams(n=3, max_tokens=16, temperature=1.0, stop_token_ids=STOPS, seed=4)
    a, b = static.generate(prompts, sp), static.generate(prompts, sp)
    _assert_same(a, b)
    assert not torch.equal(static.generate(prompts, replace(sp, seed=5)).response_ids, a.response_ids)
    assert bool((a.logprobs[a.response_mask] < 0).all()) and bool((a.logprobs[~a.response_mask] == 0).all())


def test_static_state_follows_the_cache_and_weights(tiny_model_dir):
    """The buffers (and on CUDA the graphs) belong to one cache: sleep drops them, a larger cache replaces
    them; update_weights writes into the storage they read."""
    from spmdrl.rollout.native.model import Decoder

    _, static = _pair(tiny_model_dir)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = _prompts([4, 6])
    want = static.generate(prompts, greedy)
    held = static._static
    assert held is not None and held.serves(static.model, static.cache)
    static.generate(prompts, greedy)
    assert static._static is held  # kept between calls
    static.generate(prompts * 20, greedy)  # more rows: a new cache, new buffers
    assert static._static is not held and static._static.cache is static.cache
    static.sleep(1)
    assert static._static is None
    static.wake_up()
    weights = {k: v.clone() for k, v in Decoder.iter_checkpoint(tiny_model_dir)}
    static.update_weights((k, v * 0.5 if k == "model.norm.weight" else v) for k, v in weights.items())
    assert not torch.equal(static.generate(prompts, greedy).logprobs, want.logprobs)
    static.update_weights(weights.items())
    _assert_same(static.generate(prompts, greedy), want)


def test_bucket_rows():
    ladder = [bucket_rows(n, 1000) for n in range(1, 257)]
    assert sorted(set(ladder)) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert all(n <= b < 1.5 * n or b == n for n, b in zip(range(1, 257), ladder))  # under a third padding
    assert [bucket_rows(n, 7) for n in (5, 6, 7)] == [6, 6, 7]  # never past the cache's rows
    assert bucket_rows(100, 128) == 128 and bucket_rows(100, 120) == 120
    with pytest.raises(ValueError, match="outside"):
        bucket_rows(9, 8)


def test_graph_width():
    assert [graph_width(n, 4096) for n in (1, 64, 65, 81, 200, 257, 296, 1000)] == [
        64, 64, 80, 96, 224, 320, 320, 1024]
    assert graph_width(296, 300) == 300  # never past the cache's columns
    assert all(n <= graph_width(n, 1 << 20) <= max(64, 1.25 * n) for n in range(1, 5000))


def test_cuda_graphs_key_resolves_per_device():
    cpu = torch.device("cpu")
    assert resolve_cuda_graphs("auto", cpu) is False and resolve_cuda_graphs("off", cpu) is False
    assert resolve_cuda_graphs("auto", torch.device("cuda")) is True
    with pytest.raises(ValueError, match="cuda_graphs=on needs a CUDA device, got cpu"):
        resolve_cuda_graphs("on", cpu)
    with pytest.raises(ValueError, match="valid: auto, on, off"):
        resolve_cuda_graphs("yes", cpu)


def test_config_refuses_cuda_graphs_on_cpu(capsys):
    from spmdrl.config.parse import parse_config
    from spmdrl.train import main

    grpo = str(Path(__file__).resolve().parents[2] / "configs" / "grpo.yaml")
    cfg, _ = parse_config(["--config", grpo])
    assert cfg.rollout.native_cuda_graphs == "auto"
    with pytest.raises(SystemExit) as exc:
        main(["--config", grpo, "--rollout.native_cuda_graphs", "on", "--trainer.device", "cpu"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert "rollout.native_cuda_graphs is 'on' but trainer.device 'cpu' runs on cpu" in err
    with pytest.raises(SystemExit):
        main(["--config", grpo, "--rollout.native_cuda_graphs", "fast"])
    assert "rollout.native_cuda_graphs" in capsys.readouterr().err
