"""Pure-torch CPU implementations of the `torch.ops.sgl_kernel.*_cpu` ops SGLang calls.

SGLang's CPU engine calls these through the `sgl_kernel` wheel, whose compiled library
cannot load on a machine without libcuda (and has no AVX-512/AMX-free path for some ops).
Every op here keeps SGLang's signature and in-place semantics, and is tested against an
independent reference (transformers' torch paths or a token-by-token recurrence).
Tensor layouts follow SGLang: GDN state [slots, HV, V, K], conv state [slots, D, W-1].
"""
