"""The ``hf`` rollout engine: transformers ``generate`` behind the rollout interface.

It is the reference the native engine is tested against and the baseline it is
benchmarked against; it is not fast. Same outputs as the native engine: prompts
left-padded, responses right-padded, response mask up to and including the stop
token, log-probs of the sampled tokens under the distribution they were drawn
from (after temperature, top-k and top-p; see spmdrl.rollout.sampling), finish
reasons.

The checkpoint's generation_config.json is replaced by one that holds only the
pad and EOS ids, so only the SamplingParams of each call shape sampling (no
hidden top_k=50, repetition penalty and the like from the checkpoint).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import torch

from spmdrl.parallel import rollout_coords
from spmdrl.precision import to_dtype
from spmdrl.rollout.base import (
    SLEEP_TAGS,
    TP_UNSUPPORTED,
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
    check_sleep_level,
    check_wake_tags,
    common_kwargs,
    eos_ids_from_folder,
    left_pad,
)
from spmdrl.rollout.sampling import (
    keyed_uniform,
    response_mask_and_reasons,
    row_keys,
    sample,
    stop_id_tensor,
    truncate_logits,
    validate_sampling,
)
from spmdrl.rollout.weight_store import WeightStore

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from spmdrl.config import Config


class KeyedDraw:
    """A transformers logits processor that samples each row with its keyed noise
    (spmdrl.rollout.sampling: temperature, top-k, top-p, then ``keyed_uniform`` of the row's key and
    position) and leaves only the drawn token, so greedy decoding emits exactly it."""

    def __init__(self, keys: torch.Tensor, sampling: SamplingParams, prompt_len: int) -> None:
        self.keys, self.sampling, self.prompt_len = keys, sampling, prompt_len  # keys [P*n]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        position = input_ids.shape[1] - self.prompt_len  # transformers keeps every row, in order
        u = keyed_uniform(self.keys, position)
        tokens, _ = sample(scores.float(), self.sampling, u=u)  # [P*n]
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(len(tokens)), tokens] = 0.0
        return out


class HFRollout(RolloutEngine):
    """transformers ``AutoModelForCausalLM.generate`` as a rollout engine.

    Constructor arguments are build_rollout's common ones (see NativeRollout);
    ``attn_implementation`` is passed to ``from_pretrained`` (default: transformers' choice).
    Sampling uses the global torch RNG inside ``generate``; each call runs under
    ``torch.random.fork_rng`` seeded from this engine's generator, so the caller's
    RNG is untouched and a run is reproducible.
    """

    runs_split = True

    def __init__(
        self,
        model_path: str,
        *,
        mesh: Optional["DeviceMesh"] = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str = torch.float32,
        max_num_seqs: int = 256,
        seed: int = 0,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int = 0,
        attn_implementation: Optional[str] = None,
    ):
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.dp_rank, tp = rollout_coords(mesh)
        if tp > 1:
            raise ValueError(TP_UNSUPPORTED.format(tp=tp))
        self.device, self.dtype = torch.device(device), to_dtype(dtype)
        self.max_num_seqs, self.seed = max_num_seqs, seed
        self.eos_token_ids = list(eos_token_ids) or eos_ids_from_folder(model_path)
        self.pad_token_id = pad_token_id
        kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype, **kw)
        self.model = model.to(self.device).eval()
        self.model.generation_config = GenerationConfig(pad_token_id=pad_token_id,
                                                        eos_token_id=self.eos_token_ids)
        self.generator = torch.Generator().manual_seed(seed + self.dp_rank)
        # Every parameter name (tied ones included) maps to a detached alias of its storage.
        bases, slots, optional, seen = [], {}, [], {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                optional.append(name)  # a tied alias (lm_head.weight) may be absent from a stream
            else:
                if not p.untyped_storage().resizable():  # safetensors mmap: copy so sleep(2) can free it
                    p.data = p.data.clone()
                seen[id(p)] = p.detach()
                bases.append(seen[id(p)])
            slots[name] = seen[id(p)]
        self.weights = WeightStore(bases, slots, optional)
        self._weights_valid = True

    @classmethod
    def check_config(cls, cfg: "Config") -> None:
        if cfg.parallel.rollout_tp > 1:
            raise ValueError(TP_UNSUPPORTED.format(tp=cfg.parallel.rollout_tp))

    @classmethod
    def from_config(cls, cfg: "Config", model_path: str, *, mesh: Optional["DeviceMesh"],
                    device: torch.device, eos_token_ids: Sequence[int], pad_token_id: int) -> "HFRollout":
        return cls(model_path, mesh=mesh, device=device, eos_token_ids=eos_token_ids,
                   pad_token_id=pad_token_id, **common_kwargs(cfg, device))

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (hf_name, tensor) pairs into the model's parameters in place."""
        self.weights.load(named_tensors)
        self._weights_valid = True

    def memory_bytes(self) -> int:
        """Bytes of parameter storage held (transformers' KV cache lives only inside generate)."""
        return self.weights.nbytes()

    def sleep(self, level: int = 1) -> None:
        """Level 1 moves parameters to CPU (no-op on CPU); level 2 frees their storage."""
        check_sleep_level(level)
        if level == 1:
            self.weights.offload()
        else:
            self.weights.free()
            self._weights_valid = False

    def wake_up(self, tags: Sequence[str] = SLEEP_TAGS) -> None:
        check_wake_tags(tags)
        if "weights" in tags:
            self.weights.onload()
            self.weights.materialize()

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> GenerationOutput:
        validate_sampling(sampling)
        if not self._weights_valid or not self.weights.materialized:
            raise RuntimeError("hf rollout: weights are asleep or were freed; call wake_up(('weights',)) "
                               "(and update_weights after sleep(2)) before generate")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("hf rollout: generate needs at least one prompt and no empty prompt")
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed + self.dp_rank)
        stop_ids = stop_id_tensor(self.eos_token_ids, sampling, torch.device("cpu"))
        per_chunk = max(1, self.max_num_seqs // sampling.n)
        parts = [self._generate_chunk(prompts[s:s + per_chunk], sampling, stop_ids,
                                      None if sampling.keys is None else sampling.keys[s:s + per_chunk])
                 for s in range(0, len(prompts), per_chunk)]
        response_ids = torch.cat([p[0] for p in parts])  # [N, R]
        logprobs = torch.cat([p[1] for p in parts])  # [N, R]
        mask, reasons = response_mask_and_reasons(response_ids, stop_ids, sampling.max_tokens)
        response_ids.masked_fill_(~mask, self.pad_token_id)
        logprobs.masked_fill_(~mask, 0.0)
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id, torch.device("cpu"))
        idx = torch.arange(len(prompts)).repeat_interleave(sampling.n)  # [N]
        return GenerationOutput(prompt_ids[idx], prompt_mask[idx], response_ids, mask, logprobs, reasons, idx)

    def _generate_chunk(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                        stop_ids: torch.Tensor, keys: Optional[Sequence[int]]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> response ids [P*n, R] (pad after the end) and log-probs [P*n, R] for one chunk. With ``keys``
        each row draws its own keyed noise (``KeyedDraw``) and transformers decodes greedily what it
        drew."""
        ids, valid = left_pad(prompts, self.pad_token_id, self.device)  # [P, T]
        R = sampling.max_tokens
        kw = dict(do_sample=False) if sampling.greedy else dict(
            do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0)
        copies = sampling.n
        if keys is not None and not sampling.greedy:
            from transformers import LogitsProcessorList

            # Greedy decoding returns one sequence per input: the n copies of each prompt go in as rows.
            ids, valid = ids.repeat_interleave(sampling.n, 0), valid.repeat_interleave(sampling.n, 0)
            copies = 1
            draw = KeyedDraw(row_keys(keys, sampling.n, self.device), sampling, ids.shape[1])
            kw = dict(do_sample=False, logits_processor=LogitsProcessorList([draw]))
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids, attention_mask=valid.long(), max_new_tokens=R, min_new_tokens=0,
                num_return_sequences=copies, eos_token_id=stop_ids.tolist(),
                pad_token_id=self.pad_token_id,
                output_logits=True, return_dict_in_generate=True, **kw)
        resp = out.sequences[:, ids.shape[1]:].cpu()  # [P*n, R'] with R' <= R when all rows stopped early
        logits = torch.stack(out.logits, 1).float().cpu()  # [P*n, R', V] raw logits
        if not sampling.greedy:  # the distribution transformers sampled from: temperature, top-k, top-p
            P, Rr, V = logits.shape
            logits = truncate_logits((logits / sampling.temperature).view(P * Rr, V), sampling.top_k,
                                     sampling.top_p).view(P, Rr, V)
        lp = torch.log_softmax(logits, -1).gather(-1, resp[..., None]).squeeze(-1)  # [P*n, R']
        pad = R - resp.shape[1]
        resp = torch.nn.functional.pad(resp, (0, pad), value=self.pad_token_id)
        return resp, torch.nn.functional.pad(lp, (0, pad))
