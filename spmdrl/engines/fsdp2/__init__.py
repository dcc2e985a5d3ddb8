"""The FSDP2 training engine (``engine``), its parallelisation (``parallelize``), fused kernels (``fused``) and
sharded-weight helpers."""
