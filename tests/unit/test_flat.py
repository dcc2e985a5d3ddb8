"""Weights as flat byte buffers (spmdrl/rollout/flat.py), and which GPU a split placement's own-process vLLM
engine is started on."""

from __future__ import annotations

import torch

from spmdrl.rollout.flat import ALIGN, flatten, unflatten


def test_a_bucket_of_mixed_dtypes_and_shapes_comes_back_bitwise() -> None:
    g = torch.Generator().manual_seed(0)
    bucket = [("a", torch.randn(3, 5, generator=g).bfloat16()), ("b", torch.randn(7, generator=g)),
              ("c", torch.arange(5, dtype=torch.int64)), ("d", torch.randn(2, 3, generator=g)[:, 1]),
              ("e", torch.randn((), generator=g).half())]
    flat, parts = flatten(bucket)
    assert flat.dtype == torch.uint8 and all(offset % ALIGN == 0 for *_, offset in parts)
    # Through bytes, as a bucket reaches vLLM's worker process on CPU.
    back = unflatten(torch.frombuffer(bytearray(flat.numpy().tobytes()), dtype=torch.uint8), parts)
    assert [n for n, _ in back] == [n for n, _ in bucket]
    for (_, want), (_, got) in zip(bucket, back):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_the_own_process_engine_starts_on_this_ranks_gpu(monkeypatch) -> None:
    from spmdrl.rollout.vllm import visible_device

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_device(torch.device("cuda", 3)) == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")  # this process's cuda:1 is the node's GPU 6
    assert visible_device(torch.device("cuda", 1)) == "6"
