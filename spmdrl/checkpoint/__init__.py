"""Checkpoints: atomic saves of a dict of stateful parts and exact resume (``manager``), DCP loading that runs
no pickle (``safe_load``), folder names and verification (``layout``), stop-on-signal (``preemption``), RNG
streams (``rng``) and Hugging Face folders (``hf_folder``); and what keeps a run's files and time safe: the
output folder's lock and the earlier run's files on a fresh start (``run_folder``), and the hang watchdog
(``watchdog``)."""
