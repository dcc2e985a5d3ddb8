"""Where user code runs: worker processes (``pool``) for reward functions and tools."""
