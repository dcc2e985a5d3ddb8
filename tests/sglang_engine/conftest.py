"""The fixtures every library engine's tests share (tests/engine_contract.py)."""

from engine_contract import native, weights  # noqa: F401
