"""The Megatron-core training engine (``engine``), its HF <-> Megatron conversion (``convert``), process-group
set-up (``setup``) and the CPU compatibility shims (``cpu``)."""
