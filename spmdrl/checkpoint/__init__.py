"""Checkpoints: atomic saves of a dict of stateful parts and exact resume (``manager``), DCP loading that runs
no pickle (``safe_load``), folder names and verification (``layout``), stop-on-signal (``preemption``), RNG
streams (``rng``) and Hugging Face folders (``hf_folder``)."""
