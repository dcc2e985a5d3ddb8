"""Build a small Qwen2-architecture model folder offline, for tests, the default run and benchmarks.

    python -m spmdrl.builtin.models --out /tmp/tiny --size tiny --seed 0

Writes a Hugging Face folder: config.json, model.safetensors (random weights),
generation_config.json and a byte-level BPE tokenizer trained with the
``tokenizers`` library on a built-in corpus, with a ChatML chat template. The
same size and seed always give the same bytes. Nothing is downloaded, so
``AutoModelForCausalLM.from_pretrained(out)`` works with ``HF_HUB_OFFLINE=1``.

``builtin:qwen2.5-0.5b-shape`` and ``builtin:qwen2.5-1.5b-shape`` are Qwen2.5-0.5B's and -1.5B's shapes with
random weights and the same tokenizer, for the GPU kit (``bench/gpu/``). ``builtin:tiny-moe`` is a
Qwen3-MoE model of tiny's attention with 8 experts a layer, 2 routed a token (a size's ``model_type``
picks the architecture; qwen2 when it names none).

``resolve_builtin_model`` builds ``builtin:tiny`` under the cache on first use (rank 0 builds, the
others wait).
``--reward`` (``builtin:tiny-rm``) writes a reward model instead:
``Qwen2ForSequenceClassification`` with one label, the same tokenizer, no
generation config, for ``reward_model.model.path`` in tests.

A warm start (``builtin:tiny-arith``, the shipped configs' ``model.path``) is a built-in model after a short
run of ``spmdrl.sft`` on a built-in task: RL then starts, as it does in practice, from a model that already
answers in the task's form, and raises its accuracy. It is trained on first use by a child
``python -m spmdrl.sft`` (a process of its own, so the SFT run's process group never meets the RL run's) and
cached; its folder keeps the SFT run's metrics (``sft_metrics.jsonl``) and recipe (``spmdrl_builtin.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from spmdrl.cache import cache_dir

SIZES: dict[str, dict] = {
    # ~4.7M parameters: unit and end-to-end tests, the default run.
    "tiny": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2),
    # ~38M parameters: benchmarks (the size the issues' reference figures were measured on).
    "small": dict(hidden_size=512, intermediate_size=2560, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4),
    # Qwen2.5-0.5B's config.json shapes (494,032,768 parameters, tied embeddings), random weights stored in
    # bfloat16 as that checkpoint is: the GPU kit's model (bench/gpu/), so its throughput figures are for a
    # size users train. The built-in tokenizer's 2,048 ids are the first rows of Qwen's 151,936-row
    # embedding; the other rows are padding, as a real Qwen2.5 checkpoint pads its 151,665 ids to 151,936:
    # the same matmul work per token, and a sampled padding id decodes to no text.
    "qwen2.5-0.5b-shape": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, max_window_layers=24,
                               vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                               torch_dtype="bfloat16"),
    # Qwen2.5-1.5B-Instruct's config.json shapes (1,543,714,304 parameters, tied): the GPU kit's second size,
    # so its table shows how the cost grows with the model.
    "qwen2.5-1.5b-shape": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                               num_attention_heads=12, num_key_value_heads=2, max_window_layers=21,
                               vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                               torch_dtype="bfloat16"),
    # 7.6M parameters (2.9M active a token): tiny's attention with a Qwen3-MoE feed-forward of 8 experts,
    # 2 routed a token, in every layer: one tensor per expert in the folder, fused [experts, ...] tensors
    # once transformers (5.x) has loaded them.
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=1024,
                     moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64),
    # tiny-moe's dense twin for bench/step.py: the same attention (Qwen3's q / k norms) and an MLP as wide as
    # the 2 experts a token runs (2 x 256), so the same active parameters but the router's 8 x 256.
    "tiny-moe-dense": dict(model_type="qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    # Qwen3-30B-A3B's config.json shapes (30,532,122,624 parameters, 3.3B active a token): 48 layers of 128
    # experts, 8 routed a token. For --trainer.plan_only alone (PLAN_ONLY): never built.
    "qwen3-30b-a3b-shape": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                                moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                                rope_theta=1000000.0, tie_word_embeddings=False, torch_dtype="bfloat16"),
}
# Shapes only the memory plan reads: building one would write tens of gigabytes of random weights.
PLAN_ONLY = ("qwen3-30b-a3b-shape",)
# Config values of every built-in model unless its SIZES entry sets them (vocab_size: the tokenizer's).
_CONFIG_DEFAULTS: dict[str, Any] = dict(max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
                                        tie_word_embeddings=True, torch_dtype="float32")
# name -> the spmdrl.sft keys that train it. The schedule is configs/sft.yaml's, cut to 75 steps: the model
# answers with a bare number, right ~35% of the time when sampled at temperature 1, so GRPO has room to show
# what it adds (from 100 SFT steps it starts near 0.45 and gains less; from 50 it ends below 0.6 at seed 2).
_ARITH_SFT: dict[str, Any] = {
    "data.train_files": "builtin:arith_sft", "data.val_files": "builtin:arith_sft",
    "data.train_batch_size": 32, "data.micro_batch_size_per_gpu": 32, "data.max_length": 64, "actor.lr": 1e-3,
    "actor.lr_warmup_steps": 10, "actor.lr_scheduler": "cosine", "actor.min_lr_ratio": 0.1,
    "trainer.total_steps": 75,
}
WARM_STARTS: dict[str, dict[str, Any]] = {
    "tiny-arith": {"model.path": "builtin:tiny", **_ARITH_SFT},
    # The MoE main job's (configs/grpo_moe.yaml) warm start: tiny-moe after the same SFT recipe.
    "tiny-moe-arith": {"model.path": "builtin:tiny-moe", **_ARITH_SFT},
}
# Bump when a recipe (or the SFT trainer's arithmetic) changes, so a stale cached warm start is not reused.
WARM_START_VERSION = 2
# What torchrun sets for its children: without them the SFT child runs as a world of one, not as a member of
# the RL run's rendezvous.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen2 uses: generation continues after "<|im_start|>assistant\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus(seed: int) -> list[str]:
    """Text the tokenizer is trained on: arithmetic, digits, short English and chat markup."""
    rng = random.Random(seed)
    words = (
        "the a an of to and in is it you that he was for on are as with his they at be this have from or one "
        "had by word but not what all were we when your can said there use each which she do how their if "
        "will up other about out many then them these so some her would make like him into time has look two "
        "more write go see number no way could people my than first water been call who oil its now find "
        "long down day did get come made may part answer question solve compute add subtract sum total "
        "result reverse copy repeat letters digits count plus minus times equals what is the value of please "
        "think step by step final user assistant system you are a helpful assistant"
    ).split()
    lines = []
    for _ in range(4000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        lines.append(f"What is {a} {op} {b}? Answer: {value}")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
        lines.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))))
    lines += [f"<|im_start|>user\n{line}<|im_end|>\n<|im_start|>assistant\n" for line in lines[:200]]
    return lines


def build_tokenizer(out: Path, seed: int) -> "object":
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Single digits as their own pre-tokens keep arithmetic learnable for a tiny model.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def _config_values(size: str, vocab: int) -> dict[str, Any]:
    return {**_CONFIG_DEFAULTS, "vocab_size": vocab, **SIZES[size]}


def _architecture(size: str) -> str:
    """The transformers model type of built-in size ``size``: qwen2 unless its SIZES entry names one."""
    return SIZES[size].get("model_type", "qwen2")


def model_config(size: str, tok: Any) -> Any:
    """The config (Qwen2Config, or the size's own architecture's) of built-in model ``size`` with tokenizer
    ``tok`` (its special ids; its length is the vocabulary unless the size sets a wider one)."""
    from transformers import AutoConfig

    if size not in SIZES:
        raise ValueError(f"unknown tiny-model size {size!r}; valid sizes: {', '.join(SIZES)}")
    values = {k: v for k, v in _config_values(size, len(tok)).items() if k != "model_type"}
    return AutoConfig.for_model(_architecture(size), bos_token_id=tok.pad_token_id,
                                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **values)


def build_model(out: Path, size: str = "tiny", seed: int = 0, reward: bool = False) -> Path:
    """Write the model folder ``out`` (replacing it atomically) and return it. ``reward``: a reward model,
    Qwen2ForSequenceClassification with one label (a random scalar head on the same backbone shape and
    tokenizer), as ``reward_model.model.path`` loads it."""
    if size in PLAN_ONLY:
        raise ValueError(f"builtin:{size} is a shape for --trainer.plan_only true and is never built")
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    if size not in SIZES:
        raise ValueError(f"unknown tiny-model size {size!r}; valid sizes: {', '.join(SIZES)}")
    out = Path(out)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent if out.parent.exists() else None))
    try:
        tok = build_tokenizer(tmp, seed)
        cfg = model_config(size, tok)
        if reward:
            cfg.num_labels = 1  # one scalar score per sequence
        # fork_rng keeps the caller's global RNG untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = (AutoModelForSequenceClassification if reward else AutoModelForCausalLM).from_config(cfg)
            model = model.to(getattr(torch, _config_values(size, len(tok))["torch_dtype"]))
        model.save_pretrained(tmp, safe_serialization=True)
        if not reward:
            GenerationConfig(
                bos_token_id=tok.pad_token_id, eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id
            ).save_pretrained(tmp)
        info = {"size": size, "seed": seed, **({"reward": True} if reward else {})}
        (tmp / "spmdrl_builtin.json").write_text(json.dumps(info) + "\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def builtin_config(path: str) -> dict[str, Any]:
    """The config.json values of a ``builtin:`` model without building it (the memory plan reads them
    before any model exists)."""
    _, size, _ = check_builtin_model(path)
    return {"model_type": _architecture(size), **_config_values(size, VOCAB_SIZE)}


def check_builtin_model(path: str) -> tuple[str, str, bool]:
    """(name, size, is a reward model) of a ``builtin:`` model path (a warm start has its base model's size);
    ValueError listing the valid ones."""
    name = path.split(":", 1)[1]
    if name in WARM_STARTS:
        return name, WARM_STARTS[name]["model.path"].split(":", 1)[1], False
    size, reward = (name[: -len("-rm")], True) if name.endswith("-rm") else (name, False)
    if size not in SIZES:
        valid = [f"builtin:{s}" for s in SIZES] + [f"builtin:{s}-rm" for s in SIZES] + \
            [f"builtin:{w}" for w in WARM_STARTS]
        raise ValueError(f"unknown built-in model {path!r}; valid: {', '.join(valid)}")
    return name, size, reward


def build_warm_start(out: Path, name: str, seed: int = 0) -> Path:
    """Train the warm start ``name`` with a child ``python -m spmdrl.sft`` and move its Hugging Face folder to
    ``out``; return ``out``. RuntimeError with the tail of the child's output when it fails."""
    recipe = WARM_STARTS[name]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    args = [f"--{k}={v}" for k, v in recipe.items()] + [
        f"--trainer.seed={seed}", f"--trainer.output_dir={tmp / 'run'}", "--trainer.logger=[jsonl]",
        "--trainer.progress_bar=false", "--trainer.plot_freq=0", "--trainer.resume=off"]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("TORCHELASTIC")}
    print(f"[spmdrl] building builtin:{name} once: {recipe['trainer.total_steps']} SFT steps of "
          f"{recipe['model.path']} on {recipe['data.train_files']} (about 20 s on 2 CPU cores) -> {out}",
          flush=True)
    start = time.perf_counter()
    try:
        child = subprocess.run([sys.executable, "-m", "spmdrl.sft", *args], env=env, capture_output=True,
                               text=True)
        if child.returncode != 0:
            raise RuntimeError(f"building builtin:{name} failed: spmdrl.sft exited {child.returncode}\n"
                               f"{(child.stdout + child.stderr)[-3000:]}")
        run, hf = tmp / "run", tmp / "run" / "hf"
        last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
        shutil.copyfile(run / "metrics.jsonl", hf / "sft_metrics.jsonl")
        info = {"warm_start": name, "version": WARM_START_VERSION, "seed": seed, "sft": recipe,
                "train/loss": last["train/loss"], "val/loss": last.get("val/loss")}
        (hf / "spmdrl_builtin.json").write_text(json.dumps(info) + "\n")
        if out.exists():  # a folder without spmdrl_builtin.json: an earlier build that did not finish
            shutil.rmtree(out)
        try:
            os.rename(hf, out)
        except OSError:  # another run on this cache finished the same build first: keep its folder
            if not (out / "spmdrl_builtin.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[spmdrl] built builtin:{name} in {time.perf_counter() - start:.0f} s "
          f"(SFT loss {last['train/loss']:.3f}, validation loss {last.get('val/loss', float('nan')):.3f})",
          flush=True)
    return out


def resolve_builtin_model(path: str, seed: int = 0) -> str:
    """Map ``builtin:<size>`` (a policy), ``builtin:<size>-rm`` (a reward model of that size) or a warm start
    (``builtin:tiny-arith``) to a cache folder, building it when missing; other paths pass through.

    Call on every rank: rank 0 builds, the others wait at a barrier.
    """
    if not path.startswith("builtin:"):
        return path
    import torch.distributed as dist

    name, size, reward = check_builtin_model(path)
    warm = name in WARM_STARTS
    folder = f"{name}-v{WARM_START_VERSION}-seed{seed}" if warm else f"{name}-seed{seed}"
    out = cache_dir() / "models" / folder
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and not (out / "spmdrl_builtin.json").exists():
        if warm:
            build_warm_start(out, name, seed)
        else:
            build_model(out, size, seed, reward=reward)
    if dist.is_initialized():
        dist.barrier()
    return str(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder to write (replaced if it exists)")
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reward", action="store_true",
                   help="a reward model (sequence classification, one label)")
    args = p.parse_args(argv)
    out = build_model(Path(args.out), args.size, args.seed, reward=args.reward)
    n = sum(1 for _ in out.iterdir())
    kind = ", reward model" if args.reward else ""
    print(f"wrote {out} ({n} files, size={args.size}, seed={args.seed}{kind})")


if __name__ == "__main__":
    main()
