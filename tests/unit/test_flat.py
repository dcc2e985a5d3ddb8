"""Weights as flat byte buffers (spmdrl/rollout/flat.py), and where an engine that runs in processes of its
own (split placement's vLLM, SGLang) is started: which GPUs, which CPUs."""

from __future__ import annotations

import pytest
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


def test_the_own_process_engine_starts_on_its_groups_gpus(monkeypatch) -> None:
    """The engine's processes see this rank's GPU first, then its rollout TP group's next ones."""
    from spmdrl.rollout.vllm import visible_devices

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert visible_devices(torch.device("cuda", 3)) == "3"
    assert visible_devices(torch.device("cuda", 2), 2) == "2,3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")  # this process's cuda:1 is the node's GPU 6
    assert visible_devices(torch.device("cuda", 1)) == "6"
    assert visible_devices(torch.device("cuda", 1), 2) == "6,7"
    with pytest.raises(ValueError, match="needs GPUs 1..3 visible to its first rank, which sees 3"):
        visible_devices(torch.device("cuda", 1), 3)


def test_an_engine_whose_tp_ranks_are_processes_binds_each_to_its_share_of_the_cpus(monkeypatch) -> None:
    from spmdrl.rollout.base import cpu_threads_bind

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpu_threads_bind(2) == "0,1|2,3"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert cpu_threads_bind(2) == "0|1"
    assert cpu_threads_bind(3) == "0|0|1"  # fewer CPUs than TP ranks: one shared
