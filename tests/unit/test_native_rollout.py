"""The native rollout engine against transformers with the same weights, and its weight/memory life cycle.

    pytest tests/unit/test_native_rollout.py
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from spmdrl.rollout import build_rollout
from spmdrl.rollout.base import SamplingParams
from spmdrl.rollout.native.config import DecoderConfig, rope_inv_freq
from spmdrl.rollout.native.engine import NativeRollout, left_pad
from spmdrl.rollout.native.model import Decoder

EOS, PAD = 2, 0


def _prompts(lengths: list[int], seed: int = 0, vocab: int = 2048) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _positions(valid: torch.Tensor) -> torch.Tensor:
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


def _engine(path: Path, **kw) -> NativeRollout:
    kw.setdefault("eos_token_ids", [EOS])
    return NativeRollout(str(path), pad_token_id=PAD, **kw)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These batches are tiny: one thread avoids OpenMP stalls when other jobs share the cores
    (measured: a 2-thread 12-token call took 3.6 s on a busy 2-core machine, 0.06 s on one thread)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> NativeRollout:
    return _engine(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):
    return _hf(tiny_model_dir)


def _native_logits(eng: NativeRollout, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids, valid = left_pad(prompts, PAD, torch.device("cpu"))
    with torch.inference_mode():
        return eng.model.logits(eng.model.prefill(ids, _positions(valid), valid)), valid


def _hf_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    ids, valid = left_pad(prompts, PAD, torch.device("cpu"))
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=valid.long(), position_ids=_positions(valid)).logits


def test_logits_match_transformers_fp32(engine, hf_model):
    prompts = _prompts([3, 11, 7, 16])
    mine, valid = _native_logits(engine, prompts)
    ref = _hf_logits(hf_model, prompts)
    assert (mine - ref)[valid].abs().max().item() < 1e-4


def _save_random(tmp: Path, kind: str) -> Path:
    """A random Qwen3 or Llama checkpoint exercising q/k-norm, rope scaling, biases and untied heads."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if kind == "qwen3":
        cfg = Qwen3Config(head_dim=32, tie_word_embeddings=True, rope_theta=1e6, **common)
        cls = Qwen3ForCausalLM
    elif kind.startswith("qwen3_moe"):  # 6 experts, 2 a token; the weights renormalised or not
        cfg = Qwen3MoeConfig(head_dim=32, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
                             norm_topk_prob=kind.endswith("norm"), tie_word_embeddings=False, **common)
        cls = Qwen3MoeForCausalLM
    else:
        rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        cfg = LlamaConfig(tie_word_embeddings=False, attention_bias=True, mlp_bias=True, rope_parameters=rope,
                          **common)
        cls = LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = cls(cfg).float()
        with torch.no_grad():  # non-trivial norm weights and biases so that mistakes in them show up
            for name, p in model.named_parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.1)
    out = tmp / kind
    # A small shard size makes save_pretrained write a sharded index, which the loader must follow.
    model.save_pretrained(out, max_shard_size="200KB")
    return out


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen3_moe", "qwen3_moe_norm"])
def test_logits_match_transformers_other_architectures(tmp_path, kind):
    path = _save_random(tmp_path, kind)
    if kind == "llama":
        assert (path / "model.safetensors.index.json").exists()
    prompts = _prompts([5, 12, 2], vocab=512)
    mine, valid = _native_logits(_engine(path), prompts)
    ref = _hf_logits(_hf(path), prompts)
    assert (mine - ref)[valid].abs().max().item() < 1e-4


def test_moe_samples_route_and_load_as_transformers(tmp_path):
    """A Qwen3-MoE model: sampled log-probs with early stops equal transformers', every token the engine ran
    is routed as transformers' routers route it (the trainer's routing, ``engines/fsdp2/moe.py``), a token it
    never ran (each row's last) is ``unrouted``, and the trainer's fused expert tensors load as the
    checkpoint's one tensor an expert does."""
    from spmdrl.engines.fsdp2.moe import install_routing

    path = _save_random(tmp_path, "qwen3_moe_norm")
    hf = _hf(path)
    eng, prompts = _engine(path, seed=3), _prompts([6, 2, 9], seed=4, vocab=512)
    stops = list(range(3, 512, 17))
    out = eng.generate(prompts, SamplingParams(n=2, max_tokens=12, temperature=1.0, stop_token_ids=stops))
    assert 1 <= out.response_lengths.min() < out.response_lengths.max()
    torch.testing.assert_close(out.logprobs, _hf_logprobs(hf, out, 1.0), atol=1e-5, rtol=0)
    routing = install_routing(hf)
    full = torch.cat([out.prompt_ids, out.response_ids], 1)
    mask = torch.cat([out.prompt_mask, out.response_mask], 1)  # [N, P+R]
    routing.begin(None, None, force=False, observe=False, record=True)
    with torch.inference_mode():
        hf(input_ids=full, attention_mask=mask.long(), position_ids=_positions(mask))
    theirs = routing.recorded().view(*full.shape, 2, 2).sort(-1).values  # [N, P+R, L, k]
    mine = out.routed_experts.sort(-1).values
    ran = mask.clone()
    ran[torch.arange(len(out)), out.prompt_ids.shape[1] + out.response_lengths - 1] = False  # never fed
    assert torch.equal(mine[ran], theirs[ran]) and (out.routed_experts[mask & ~ran] == 255).all()
    # The trainer's layout: [experts, ...] tensors under transformers' in-memory names.
    fused = _engine(path, load_weights=False)
    fused.update_weights(hf.state_dict().items())
    assert any(".mlp.experts.gate_up_proj" in k for k in hf.state_dict())
    greedy_params = SamplingParams(n=2, max_tokens=12, temperature=0.0)
    again, greedy = fused.generate(prompts, greedy_params), eng.generate(prompts, greedy_params)
    assert torch.equal(again.response_ids, greedy.response_ids)
    assert torch.equal(again.logprobs, greedy.logprobs)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
])
def test_rope_scaling_matches_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=2048,
                      rope_parameters={"rope_theta": 10000.0, **rope})
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu", seq_len=2048)
    inv, scale = rope_inv_freq(DecoderConfig.from_hf(cfg.to_dict()))
    torch.testing.assert_close(inv, ref_inv)
    assert scale == pytest.approx(ref_scale)


def test_greedy_matches_transformers_generate(engine, hf_model):
    prompts = _prompts([4, 9, 1, 13, 6], seed=3)
    out = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    ids, valid = left_pad(prompts, PAD, torch.device("cpu"))
    ref = hf_model.generate(input_ids=ids, attention_mask=valid.long(), max_new_tokens=24, do_sample=False,
                            eos_token_id=EOS, pad_token_id=PAD)[:, ids.shape[1]:]
    assert torch.equal(out.response_ids[:, :ref.shape[1]], ref)
    assert torch.equal(out.prompt_ids, ids) and torch.equal(out.prompt_mask, valid)


def _hf_logprobs(model, out, temperature: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """log_softmax(truncate(transformers logits / T)) at the response tokens, 0 on padding: the sampling
    distribution's log-probs (spmdrl.rollout.sampling). -> [N, R]"""
    from spmdrl.rollout.sampling import truncate_logits

    full = torch.cat([out.prompt_ids, out.response_ids], 1)
    mask = torch.cat([out.prompt_mask, out.response_mask], 1)
    with torch.inference_mode():
        logits = model(input_ids=full, attention_mask=mask.long(), position_ids=_positions(mask)).logits
    P = out.prompt_ids.shape[1]
    scaled = logits[:, P - 1:-1].float() / temperature  # [N, R, V]
    N, R, V = scaled.shape
    lp = torch.log_softmax(truncate_logits(scaled.reshape(N * R, V), top_k, top_p).view(N, R, V), -1)
    lp = lp.gather(-1, out.response_ids[..., None]).squeeze(-1)  # padding may be outside the kept set: -inf
    return torch.where(out.response_mask, lp, 0.0)


def test_sampled_logprobs_match_transformers_with_early_stops(hf_model, tiny_model_dir):
    # Many stop ids make rows finish at different steps, so compaction moves cache rows around;
    # a row whose cache was mixed up would score differently under transformers.
    stop = list(range(3, 2048, 31))
    eng = _engine(tiny_model_dir, seed=7)
    # 40 new tokens on 10-token prompts also makes the cache view widen twice while rows leave.
    sp = SamplingParams(n=3, max_tokens=40, temperature=0.7, top_p=0.9, top_k=50, stop_token_ids=stop)
    out = eng.generate(_prompts([6, 2, 10, 4], seed=5), sp)
    assert len(out) == 12 and out.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    lengths = out.response_lengths
    assert 1 <= lengths.min() < lengths.max()
    torch.testing.assert_close(out.logprobs, _hf_logprobs(hf_model, out, 0.7, top_k=50, top_p=0.9),
                               atol=1e-4, rtol=0)
    stop_t = torch.tensor(stop + [EOS])
    for i, reason in enumerate(out.finish_reasons):
        n = int(lengths[i])
        resp = out.response_ids[i]
        assert (resp[n:] == PAD).all() and not torch.isin(resp[:n - 1], stop_t).any()
        assert reason == ("stop" if bool(torch.isin(resp[n - 1], stop_t)) else "length")
        assert reason == "stop" or n == 40


@pytest.mark.parametrize("n,w,w2", [(2048, 32, 48), (7, 16, 80), (3, 16, 17), (1, 4, 8)])
def test_widen_rows_in_place(n, w, w2):
    from spmdrl.rollout.native.cache import _widen_rows

    flat = torch.arange(n * w2 * 3 + 5, dtype=torch.float32)
    want = flat[:n * w * 3].view(n, w, 3).clone()
    _widen_rows(flat, n, w, w2, 3)
    assert torch.equal(flat[:n * w2 * 3].view(n, w2, 3)[:, :w], want)


def test_seeded_runs_reproduce_and_differ(tiny_model_dir):
    prompts = _prompts([5, 8], seed=2)
    sp = SamplingParams(n=4, max_tokens=12, temperature=1.0)
    a = _engine(tiny_model_dir, seed=11).generate(prompts, sp)
    b = _engine(tiny_model_dir, seed=11).generate(prompts, sp)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    # The n samples of a prompt share its prefill but are drawn independently.
    assert not torch.equal(a.response_ids[0], a.response_ids[1])
    eng = _engine(tiny_model_dir, seed=0)
    s1 = eng.generate(prompts, SamplingParams(n=2, max_tokens=12, seed=5))
    s2 = eng.generate(prompts, SamplingParams(n=2, max_tokens=12, seed=5))
    s3 = eng.generate(prompts, SamplingParams(n=2, max_tokens=12, seed=6))
    assert torch.equal(s1.response_ids, s2.response_ids) and not torch.equal(s1.response_ids, s3.response_ids)


def test_chunking_by_max_num_seqs_keeps_greedy_output(engine, tiny_model_dir):
    prompts = _prompts([3, 7, 5, 9, 2], seed=4)
    sp = SamplingParams(n=2, max_tokens=10, temperature=0.0)
    small = _engine(tiny_model_dir, max_num_seqs=4).generate(prompts, sp)  # chunks of 2 prompts
    full = engine.generate(prompts, sp)
    assert torch.equal(small.response_ids, full.response_ids)
    torch.testing.assert_close(small.logprobs, full.logprobs, atol=1e-5, rtol=0)


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return dict(Decoder.iter_checkpoint(path))


def test_update_weights_in_place_and_errors(tiny_model_dir, tmp_path):
    from spmdrl.builtin.models import build_model

    eng = _engine(tiny_model_dir)
    ptr = eng.model.flat.data_ptr()
    other = build_model(tmp_path / "other", "tiny", seed=1)
    prompts = _prompts([4, 6])
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    want = _engine(other).generate(prompts, greedy)
    sd = _checkpoint(other)
    assert "lm_head.weight" not in sd  # tied: the stream may omit the head
    eng.update_weights(sd.items())
    assert eng.model.flat.data_ptr() == ptr
    assert torch.equal(eng.generate(prompts, greedy).response_ids, want.response_ids)

    with pytest.raises(KeyError, match="model.layers.0.bogus"):
        eng.update_weights([("model.layers.0.bogus", torch.zeros(1))])
    with pytest.raises(ValueError, match="did not contain"):
        eng.update_weights([(k, v) for k, v in sd.items() if "layers.1.mlp.up_proj" not in k])
    with pytest.raises(ValueError, match="shape"):
        eng.update_weights([("model.norm.weight", torch.zeros(3))])


def test_sleep_level2_frees_everything_and_wake_update_restores(tiny_model_dir):
    eng = _engine(tiny_model_dir, seed=3)
    prompts = _prompts([5, 3, 9], seed=8)
    sp = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=42)
    before = eng.generate(prompts, sp)
    weight_bytes = eng.model.weights.nbytes()
    assert eng.memory_bytes() > weight_bytes  # the KV cache is held between calls

    eng.sleep(1)  # on CPU: the cache goes, the weights stay
    assert eng.memory_bytes() == weight_bytes
    eng.wake_up()
    assert torch.equal(eng.generate(prompts, sp).response_ids, before.response_ids)

    eng.sleep(2)
    assert eng.memory_bytes() == 0
    with pytest.raises(RuntimeError, match="wake_up"):
        eng.generate(prompts, sp)
    eng.wake_up(("weights",))
    with pytest.raises(RuntimeError, match="update_weights"):
        eng.generate(prompts, sp)  # storage is back but holds no values yet
    eng.update_weights(Decoder.iter_checkpoint(tiny_model_dir))
    eng.wake_up(("kv_cache",))
    after = eng.generate(prompts, sp)
    assert torch.equal(after.response_ids, before.response_ids)
    assert torch.equal(after.logprobs, before.logprobs)
    with pytest.raises(ValueError, match="valid tags"):
        eng.wake_up(("kv",))


class _FakeMesh:
    """Just enough of DeviceMesh for the constructor's checks."""

    def __init__(self, names: tuple[str, ...], sizes: tuple[int, ...], coords: tuple[int, ...]):
        self.mesh_dim_names, self._sizes, self._coords, self.ndim = names, sizes, coords, len(sizes)

    def size(self, dim: int) -> int:
        return self._sizes[dim]

    def get_local_rank(self, dim: int) -> int:
        return self._coords[dim]


def test_mesh_tp_rejected_and_dp_rank_offsets_seed(tiny_model_dir):
    with pytest.raises(ValueError, match="rollout_tp is 2.*one engine per rank"):
        _engine(tiny_model_dir, mesh=_FakeMesh(("dp", "tp"), (2, 2), (0, 1)))
    prompts = _prompts([4])
    sp = SamplingParams(n=2, max_tokens=8, seed=1)
    r0 = _engine(tiny_model_dir, mesh=_FakeMesh(("dp", "tp"), (2, 1), (0, 0))).generate(prompts, sp)
    r1 = _engine(tiny_model_dir, mesh=_FakeMesh(("dp", "tp"), (2, 1), (1, 0))).generate(prompts, sp)
    assert not torch.equal(r0.response_ids, r1.response_ids)


def test_hf_engine_matches_native(engine, tiny_model_dir):
    hf = build_rollout("hf", str(tiny_model_dir), eos_token_ids=[EOS], pad_token_id=PAD)
    prompts = _prompts([3, 10, 6], seed=9)
    stop = list(range(3, 2048, 7))
    greedy = SamplingParams(n=1, max_tokens=16, temperature=0.0, stop_token_ids=stop)
    a, b = hf.generate(prompts, greedy), engine.generate(prompts, greedy)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    assert a.finish_reasons == b.finish_reasons and "stop" in a.finish_reasons
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    s = hf.generate(prompts, SamplingParams(n=2, max_tokens=8, temperature=0.8, seed=3))
    torch.testing.assert_close(s.logprobs, _hf_logprobs(hf.model, s, 0.8), atol=1e-4, rtol=0)
    t = hf.generate(prompts, SamplingParams(n=2, max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=3))
    torch.testing.assert_close(t.logprobs, _hf_logprobs(hf.model, t, 0.8, top_k=20, top_p=0.9),
                               atol=1e-4, rtol=0)
    hf.sleep(2)
    assert hf.memory_bytes() == 0
    hf.wake_up()
    hf.update_weights(Decoder.iter_checkpoint(tiny_model_dir))
    assert torch.equal(hf.generate(prompts, greedy).response_ids, a.response_ids)


def test_bf16_engine_runs_and_agrees_roughly(tiny_model_dir, engine):
    eng = _engine(tiny_model_dir, dtype="bfloat16")
    prompts = _prompts([5, 9])
    mine, valid = _native_logits(eng, prompts)
    ref, _ = _native_logits(engine, prompts)
    assert mine.dtype == torch.float32 and (mine - ref)[valid].abs().max().item() < 0.1
    out = eng.generate(prompts, SamplingParams(n=2, max_tokens=6))
    assert out.response_mask.all() or "stop" in out.finish_reasons


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_ignore_eos_generates_past_eos(tiny_model_dir, kind):
    prompts = _prompts([5, 8], seed=11)
    free = _engine(tiny_model_dir, eos_token_ids=[PAD]).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0))
    eos = int(free.response_ids[0, 3])  # what greedy emits 4th becomes the EOS id
    eng = build_rollout(kind, str(tiny_model_dir), eos_token_ids=[eos], pad_token_id=PAD)
    stopped = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    assert stopped.finish_reasons[0] == "stop" and int(stopped.response_lengths[0]) <= 4
    full = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert full.finish_reasons == ["length", "length"] and bool(full.response_mask.all())
    assert torch.equal(full.response_ids, free.response_ids)


def test_session_reloads_weights_freed_by_sleep_level_2(tiny_model_dir):
    """RolloutSession owns the order: every generate inside ``awake`` sees loaded weights, however many
    calls there are, and the next ``awake`` after a level-2 sleep reloads them from the export stream."""
    from spmdrl.rollout.session import RolloutSession

    eng = _engine(tiny_model_dir)
    exports = []

    def export():
        exports.append(1)
        return Decoder.iter_checkpoint(tiny_model_dir)

    session = RolloutSession(eng, export, sleep_level=2, sleeps=True)
    greedy, prompts = SamplingParams(max_tokens=8, temperature=0.0), _prompts([4, 7])
    with session.awake() as e:
        first = e.generate(prompts, greedy)
        with session.awake() as inner:  # a nested caller (e.g. a baseline) shares the window
            assert torch.equal(inner.generate(prompts, greedy).response_ids, first.response_ids)
    assert eng.memory_bytes() == 0 and not exports  # freed; the actor had not changed, nothing loaded
    with pytest.raises(RuntimeError, match="asleep or were freed"):
        eng.generate(prompts, greedy)
    for _ in range(2):  # the first window after the sleep reloads; so does each later one at level 2
        with session.awake() as e:
            assert torch.equal(e.generate(prompts, greedy).response_ids, first.response_ids)
    assert len(exports) == 2
    level1 = RolloutSession(_engine(tiny_model_dir), export, sleep_level=1, sleeps=True)
    with level1.awake():
        pass
    with level1.awake() as e:  # level 1 keeps the weights: no reload unless the actor changed
        assert torch.equal(e.generate(prompts, greedy).response_ids, first.response_ids)
    assert len(exports) == 2
    level1.actor_changed()
    with level1.awake():
        pass
    assert len(exports) == 3


def test_session_keeps_the_tp_share_in_whole_groups(engine):
    """Each rank of a rollout TP group keeps a contiguous 1/tp of the group's prompts with all their samples;
    the shares, concatenated in rank order, are the group's output (the batch stays in rollout order)."""
    from spmdrl.rollout.base import tp_share
    from spmdrl.rollout.session import RolloutSession

    prompts = _prompts([4, 6, 3, 5, 2], seed=12)
    sp = SamplingParams(n=3, max_tokens=6, seed=4)
    full = engine.generate(prompts, sp)
    shares = []
    for rank in range(2):
        session = RolloutSession(engine, lambda: iter(()), sleep_level=1, sleeps=False, tp_rank=rank, tp=2)
        with session.awake():
            shares.append(session.generate(prompts, sp))
    assert [s.prompt_index.unique().tolist() for s in shares] == [[0, 1, 2], [3, 4]]
    for key in ("prompt_ids", "response_ids", "response_mask", "logprobs", "prompt_index"):
        assert torch.equal(torch.cat([getattr(s, key) for s in shares]), getattr(full, key)), key
    assert shares[0].finish_reasons + shares[1].finish_reasons == full.finish_reasons
    assert [list(tp_share(2, r, 4)) for r in range(4)] == [[0], [1], [], []]
    with pytest.raises(RuntimeError, match="outside"):
        RolloutSession(engine, lambda: iter(()), sleep_level=1, sleeps=False).generate(prompts, sp)


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_keyed_sampling_is_the_same_in_any_batch(engine, tiny_model_dir, kind):
    """SamplingParams.keys: a prompt's samples depend on its key alone, not on the batch around it, the
    engine's seed or its DP rank, and the native and hf engines draw the same tokens from the same key."""
    from spmdrl.rollout.sampling import response_key

    eng = engine if kind == "native" else build_rollout("hf", str(tiny_model_dir), eos_token_ids=[EOS],
                                                        pad_token_id=PAD, seed=7)
    prompts = _prompts([4, 9, 6, 3], seed=12)
    keys = tuple(response_key(1, 0, 5, i) for i in range(4))
    sp = SamplingParams(n=3, max_tokens=12, temperature=1.0, top_k=50, top_p=0.95)
    whole = eng.generate(prompts, replace(sp, keys=keys))
    # prompt 2 alone, then prompts 3 and 0 in another order, on an engine seeded differently
    other = _engine(tiny_model_dir, seed=123) if kind == "native" else eng
    alone = other.generate([prompts[2]], replace(sp, keys=keys[2:3]))
    pair = other.generate([prompts[3], prompts[0]], replace(sp, keys=(keys[3], keys[0])))
    assert torch.equal(alone.response_ids, whole.response_ids[6:9])
    assert torch.equal(pair.response_ids, torch.cat([whole.response_ids[9:12], whole.response_ids[0:3]]))
    torch.testing.assert_close(alone.logprobs, whole.logprobs[6:9], atol=1e-5, rtol=0)
    # the n samples of one key differ, and other keys draw other samples
    assert not torch.equal(whole.response_ids[0], whole.response_ids[1])
    moved = eng.generate(prompts, replace(sp, keys=tuple(response_key(1, 0, 6, i) for i in range(4))))
    assert not torch.equal(moved.response_ids, whole.response_ids)
    if kind == "hf":  # the same tokens as the native engine from the same keys
        native = engine.generate(prompts, replace(sp, keys=keys))
        assert (native.response_ids == whole.response_ids).float().mean() >= 0.99


def test_keyed_uniform_is_uniform_and_keys_mix():
    from spmdrl.rollout.sampling import keyed_uniform, response_key, row_keys

    rows = row_keys([response_key(0, 0, 1, i) for i in range(512)], 8, torch.device("cpu"))  # [4096]
    assert rows.unique().numel() == rows.numel()
    u = torch.stack([keyed_uniform(rows, t) for t in range(16)])  # [16, 4096]
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    hist = torch.histc(u, bins=16, min=0, max=1) / u.numel()
    assert float((hist - 1 / 16).abs().max()) < 0.005
    # neighbouring positions and rows are uncorrelated
    assert abs(float(torch.corrcoef(torch.stack([u[0], u[1]]))[0, 1])) < 0.05
    assert abs(float(torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1])) < 0.05
