"""hybrid_kernels: the recurrences of hybrid LLMs' linear layers, each as a pure-torch twin
(`naive.py`, the reference and the CPU path) and, for LinearKV's ops, a Triton kernel beside it.

Subpackages (shapes and conventions in each module's docstrings; overview in `kernels/README.md`):

- `hybrid_kernels.gdn`: Gated DeltaNet chunked / recurrent forward, chunk transition operator and
  state composition (state convention S [H, dk, dv], flash-linear-attention's; SGLang's pool
  stores the transpose [H, dv, dk]).
- `hybrid_kernels.mamba2`: Mamba-2 SSD scan and decode step, chunk decay and state composition.
- `hybrid_kernels.conv1d`: causal depthwise conv1d with a rolling window of past inputs.
- `hybrid_kernels.rope`: re-rotation of RoPE'd keys to shifted positions (partial rotary, NeoX or
  GPT-J pairing).

The package imports torch only; Triton is imported when a Triton kernel is first used. It never
imports SGLang. (The repository folder `kernels/` has no `__init__.py` on purpose: `kernels` is a
pip package SGLang uses and must not be shadowed.)
"""
