"""The native engine's decode step at fixed shapes, replayed as CUDA graphs on a GPU.

Why: on a GPU the eager decode step is launch-bound. A Qwen2.5-0.5B-shaped model at 128 rows took 8.5 ms
a step on an H200 while reading its weights takes ~0.25 ms: ~25 kernels per layer, each launched from
Python, plus one host sync a step to find finished rows. A CUDA graph launches the whole step at once
(on an H100, 128 rows x 256 tokens: 10.5 ms a step eager, 2.56 ms as graphs, 12,200 -> 50,100 decode
tokens/s; bench/gpu/native_graphs.py), but it needs fixed shapes and fixed addresses, so the step here:

- runs a bucket of rows (``bucket_rows``: 1, 2, 3, 4, 6, 8, 12, 16, ...), the live rows first and the
  padding after them; a padding row decodes like any other (its own cache row, a finite attention
  column), and the engine ignores what it samples;
- attends over one width per chunk (``graph_width``: the prompt plus max_tokens, rounded up a quarter
  octave), all of it from the first step: masked columns cost little next to the weights on a GPU, and
  the view's addresses never move (the CPU loop widens its view instead, see KVCache);
- reads its inputs from buffers that live as long as the cache (``StaticDecode``), and advances them
  itself: it writes the token it samples where the next step reads its input, and steps the RoPE
  positions, the cache column and the keyed uniforms' position counter, so a step needs no host work;
- samples inside the graph: keyed uniforms (``sampling.keyed_uniform``) from the rows' keys, greedy as
  argmax; with the engine's generator the uniforms are drawn into a buffer just before the replay, as a
  graph cannot advance a generator it does not own.

One graph per (bucket, width, sampling parameters), captured on first use, kept until the cache or the
weights' storage is replaced (``StaticDecode.serves``; the engine drops it on sleep too). ``update_weights``
copies into the same storage, so the graphs see new weights without a new capture.

The step is plain torch: with ``capture=False`` it runs eagerly, which is how the CPU tests prove the
fixed-shape loop samples what the dynamic one does.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

from spmdrl.rollout.base import SamplingParams
from spmdrl.rollout.native.cache import KVCache, KVView
from spmdrl.rollout.native.model import Decoder
from spmdrl.rollout.sampling import draw, keyed_uniform, sample, truncate_logits

GraphMode = Literal["auto", "on", "off"]


def resolve_cuda_graphs(mode: GraphMode, device: torch.device) -> bool:
    """``auto``: on for CUDA devices; ``on``: raise elsewhere; ``off``: the eager decode loop."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"rollout native cuda_graphs={mode!r} is not valid; valid: auto, on, off")
    if mode == "on" and device.type != "cuda":
        raise ValueError(f"native rollout: cuda_graphs=on needs a CUDA device, got {device.type}")
    return mode != "off" and device.type == "cuda"


def bucket_rows(live: int, cap: int) -> int:
    """The rows a step runs for ``live`` live rows: the smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ...
    (powers of two and their midpoints) that holds them, at most ``cap`` (the cache's rows).

    Padding rows cost compute, graphs cost a capture and memory: this ladder pads by under a third and
    needs two graphs per doubling (15 up to 256 rows), where multiples of 8 would need 32.
    """
    if not 1 <= live <= cap:
        raise ValueError(f"bucket_rows: live rows {live} outside [1, {cap}]")
    p = 1
    while True:
        for b in (p, p + p // 2):
            if b >= live:
                return min(b, cap)
        p *= 2


def graph_width(need: int, cap: int) -> int:
    """Cache columns a chunk that needs ``need`` (prompt + max_tokens) decodes over: the smallest of
    64, 80, 96, 112, 128, 160, ... (four steps per doubling) that holds them, at most ``cap``.

    Calls whose prompts differ by a few tokens share a width, hence their graphs; the masked columns
    past ``need`` are under a quarter of the width.
    """
    p = 64
    while True:
        for b in (p, p + p // 4, p + p // 2, p + 3 * p // 4):
            if b >= need:
                return min(b, cap)
        p *= 2


class StaticDecode:
    """Fixed-address decode state for one KV cache and one set of weights, and the graphs replaying it.

    Slot ``i`` of every buffer is row ``i`` of the cache view; a step over a bucket of ``b`` rows reads and
    writes slots [0, b). The engine fills the buffers at a chunk's start (``start``), moves slots when rows
    leave (``move``) and reads ``tokens`` / ``lp`` after each ``step``.
    """

    def __init__(self, model: Decoder, cache: KVCache, capture: bool):
        self.model, self.cache, self.capture = model, cache, capture
        dev, cap = cache.cos.device, cache.rows
        self.tokens = torch.zeros(cap, dtype=torch.long, device=dev)  # [cap] each slot's next input token
        self.lp = torch.zeros(cap, dtype=torch.float32, device=dev)  # [cap] the log-prob it was drawn with
        self.pos = torch.zeros(cap, dtype=torch.long, device=dev)  # [cap] its RoPE position
        self.keys = torch.zeros(cap, dtype=torch.long, device=dev)  # [cap] the slot's row key (keyed draws)
        self.u = torch.zeros(cap, dtype=torch.float32, device=dev)  # [cap] uniforms (generator draws)
        self.col = torch.zeros(1, dtype=torch.long, device=dev)  # the cache column the step writes
        self.draw = torch.zeros(1, dtype=torch.long, device=dev)  # the response position it samples
        self._weights_ptr = model.flat.data_ptr()
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        # One memory pool for every graph: a step's intermediates are dead once it ends (all it keeps is
        # in the buffers above), so graphs can reuse each other's memory whatever order they run in.
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def serves(self, model: Decoder, cache: KVCache) -> bool:
        """Whether the captured addresses are still the cache's and the weights' (a wake-up after
        sleep(1) may put the weights' storage elsewhere)."""
        return cache is self.cache and model is self.model and model.flat.data_ptr() == self._weights_ptr

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def view(self, width: int) -> KVView:
        """The cache as [L, cache rows, K, width, D]: the one layout a width's graphs address."""
        return self.cache.layout(self.cache.rows, width)

    def start(self, tokens: torch.Tensor, lp: torch.Tensor, pos: torch.Tensor, keys: Optional[torch.Tensor],
              col: int) -> None:
        """Slots [0, B) get the rows' first sampled tokens, log-probs, RoPE positions and keys ([B] each);
        the slots after them valid padding (token 0 at position 0); the step writes column ``col`` and
        samples response position 1."""
        B = tokens.shape[0]
        for buf, src in ((self.tokens, tokens), (self.lp, lp), (self.pos, pos), (self.keys, keys)):
            buf.zero_()
            if src is not None:
                buf[:B] = src
        self.col.fill_(col)
        self.draw.fill_(1)

    def move(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy slots ``src`` into slots ``dst`` (rows leaving the batch; the cache rows move separately)."""
        for buf in (self.tokens, self.lp, self.pos, self.keys):
            buf[dst] = buf[src]

    def step(self, kv: KVView, rows: int, sampling: SamplingParams, keyed: bool,
             generator: Optional[torch.Generator]) -> None:
        """Decode slots [0, rows) one token (a bucket: ``rows`` == bucket_rows(...)); ``kv``: ``view(width)``.

        ``keyed``: draw from the slots' keys; else from ``generator`` (greedy draws nothing).
        """
        if not keyed and not sampling.greedy:
            self.u[:rows].uniform_(generator=generator)
        if not self.capture:
            self._step(kv, rows, sampling, keyed)
            return
        key = (rows, kv.k.shape[3], sampling.temperature, sampling.top_k, sampling.top_p, keyed)
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        # First use: this step runs eagerly (on a side stream, which also warms up what capture must not
        # initialise: cuBLAS workspaces, lazy modules), then the capture records it without running it.
        dev = self.cache.cos.device
        side, main = torch.cuda.Stream(dev), torch.cuda.current_stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self._step(kv, rows, sampling, keyed)
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(kv, rows, sampling, keyed)
        self._graphs[key] = graph

    def _step(self, kv: KVView, B: int, sampling: SamplingParams, keyed: bool) -> None:
        """The step itself: tensor ops on the buffers only, no host sync, no Python-visible shapes that
        change between replays."""
        kv.bias[:B].index_fill_(1, self.col, 0.0)  # every slot attends to the column it writes now
        logits = self.model.decode(self.tokens[:B], self.pos[:B], kv, self.col, B)  # [B, V] fp32
        u = keyed_uniform(self.keys[:B], self.draw) if keyed else self.u[:B]  # [B]
        tokens, lp = _sample(logits, sampling, u)
        self.tokens[:B].copy_(tokens)
        self.lp[:B].copy_(lp)
        self.pos[:B].add_(1)
        self.col.add_(1)
        self.draw.add_(1)


def _sample(logits: torch.Tensor, sampling: SamplingParams, u: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampling.sample`` (the same distribution, the same draw from ``u``), with the log-prob taken as the
    log of the drawn token's probability instead of its logit minus a logsumexp, which makes five more
    passes over the [B, V] logits (~0.2 ms a step at 128 x 151,936 on an H100). The two agree to ~1e-7 in
    float32: a drawn token's probability is never 0 (see ``draw``)."""
    if sampling.greedy:
        return sample(logits, sampling)
    scaled = logits / sampling.temperature if sampling.temperature != 1.0 else logits
    if sampling.top_k > 0 or sampling.top_p < 1.0:
        scaled = truncate_logits(scaled, sampling.top_k, sampling.top_p)  # [B, V]
    probs = torch.softmax(scaled, -1)  # [B, V]
    tokens = draw(probs, u=u)  # [B]
    return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1).log()
