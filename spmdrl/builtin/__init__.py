"""The built-in models (``models``) and tasks (``tasks``, ``gsm8k``): built locally on first use, nothing
downloaded."""
