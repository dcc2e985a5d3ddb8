"""spmdrl: RL post-training for language models as one SPMD torchrun program."""

__version__ = "0.1.0"
