"""The native rollout engine (``engine``): its decoder (``model``), KV cache (``cache``) and C++ decode
kernels (``kernels``, source in ``csrc/``)."""
