"""CPU implementations of the `torch.ops.sgl_kernel.*_cpu` ops and Triton-only ops SGLang calls.

SGLang's CPU engine calls these through the `sgl_kernel` wheel, whose compiled library
cannot load on a machine without libcuda (and has no AVX-512/AMX-free path for some ops).
Every op here keeps SGLang's signature and in-place semantics (packed sequences, pool slots,
padding, chunk-grid states) and is tested against an independent reference (transformers' torch
paths or a token-by-token recurrence). The recurrences' math (GDN, Mamba-2 SSD, causal conv1d) lives
in `hybrid_kernels` (the repository's `kernels/` folder); these modules are the adapters.
Tensor layouts follow SGLang: GDN state [slots, HV, V, K], conv state [slots, D, W-1].
"""
