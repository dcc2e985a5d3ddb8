"""The FSDP2 training engine (``engine``), its critic and reward-model modules (``models``), its
parallelisation (``parallelize``), fused kernels (``fused``) and DTensor clipping and export (``weights``)."""
