"""Checkpoints: atomic sharded saves and exact resume."""
