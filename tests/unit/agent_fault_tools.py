"""Misbehaving tools for the sandbox fault tests (loaded by the workers as ``file.py:Class``)."""

import os
import time

from spmdrl.agent.tools import Tool


class RaisingTool(Tool):
    def execute(self, parameters, state):
        raise RuntimeError("tool bug")


class HangingTool(Tool):
    def execute(self, parameters, state):
        time.sleep(3600)


class GarbageTool(Tool):
    def execute(self, parameters, state):
        return {"not": "a string"}


class CrashingTool(Tool):
    def execute(self, parameters, state):
        os._exit(3)


class FloodTool(Tool):
    def execute(self, parameters, state):
        return "x" * 10_000_000


class MemoryHogTool(Tool):
    def execute(self, parameters, state):
        return str(len(bytearray(4 * 1024 ** 3)))


class CountingTool(Tool):
    """Keeps per-trajectory state across calls (it travels to the worker and back)."""

    def execute(self, parameters, state):
        state["calls"] = state.get("calls", 0) + 1
        return str(state["calls"])

    def calc_reward(self, state):
        return 0.1 * state.get("calls", 0)
