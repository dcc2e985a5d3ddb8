"""Fixtures of the unit tests that run engines without torchrun."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def gloo_world_of_one():
    """A gloo process group of one rank for the module's tests (the engines' collectives need one)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
