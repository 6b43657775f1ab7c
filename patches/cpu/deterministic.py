"""`--enable-deterministic-inference` on the CPU server: batch-invariant matrix products.

Targets (SGLang 0.5.23):

- `srt/arg_groups/choices.py::DETERMINISTIC_ATTENTION_BACKEND_CHOICES` and
  `RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND` (~lines 113, 249): the flag is refused for
  `torch_native`, the CPU server's attention backend, and (were it admitted only to the first list)
  the prefix cache would be turned off. `torch_native` attention computes each request on its own
  (one SDPA per sequence, `extend_attention` likewise), so its output does not depend on the batch:
  it is admitted to both.
- `srt/model_executor/model_runner.py::ModelRunner.maybe_enable_batch_invariant_mode` (~line 842):
  SGLang's batch-invariant mode registers Triton GEMMs for an accelerator's dispatch key and raises
  "No supported accelerator" without one. On CPU it registers `cpu_batch_invariant_mm` for
  `aten::mm` and `aten::addmm` instead: every row of the left operand is multiplied on its own (one
  `torch.mv` each, on a fresh copy of the row: a BLAS reduction's order can follow its operand's
  address), so a token's projections are computed by the same call whatever else shares its batch.
  Per-sequence products (`bmm` inside the linear layers' CPU ops) are not overridden: each runs
  within one request. Other row-wise reductions (norms, softmax) are left to torch; what they still
  leave between a request alone and in a batch is measured by the fuzzer (`measure_noise`).

With the flag the sampler also honours `sampling_params.sampling_seed` (SGLang reads it only under
deterministic inference), which the exactness fuzzer's sampled path needs. Applied only where
`torch.cuda.is_available()` is False; a no-op otherwise and when applied twice.
"""

from __future__ import annotations

import functools

import torch

TARGET = ("srt/arg_groups/choices.py: DETERMINISTIC_ATTENTION_BACKEND_CHOICES, "
          "RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND; "
          "srt/model_executor/model_runner.py: ModelRunner.maybe_enable_batch_invariant_mode")

#: the CPU server's attention backend, admitted under deterministic inference
CPU_BACKEND = "torch_native"
_LIB: list = []   # the torch.library registration, kept alive


def cpu_batch_invariant_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` (2-D) with each row of `a` multiplied alone: row i of the result does not depend
    on the other rows."""
    if a.dim() != 2 or b.dim() != 2:
        raise RuntimeError(f"mm expects 2-D operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise RuntimeError(f"mm shapes do not match: {tuple(a.shape)} @ {tuple(b.shape)}")
    out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.promote_types(a.dtype, b.dtype), device=a.device)
    bt = b.t()
    for i in range(a.shape[0]):
        # the row copied to a fresh (allocator-aligned) buffer: a BLAS reduction's order can follow
        # its operand's address, which for a row of a batch depends on the rows before it
        out[i] = torch.mv(bt, a[i].clone())
    return out


def cpu_batch_invariant_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
                              beta: float = 1, alpha: float = 1) -> torch.Tensor:
    """`beta * bias + alpha * (a @ b)` with `cpu_batch_invariant_mm` (bias broadcast per row)."""
    prod = cpu_batch_invariant_mm(a, b)
    if alpha != 1:
        prod = prod * alpha
    return prod + (bias if beta == 1 else bias * beta)


def enable_cpu_batch_invariant_mode() -> None:
    """Register the row-by-row products for the CPU dispatch key (once per process)."""
    if _LIB:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("aten::mm", cpu_batch_invariant_mm, "CPU")
    lib.impl("aten::addmm", cpu_batch_invariant_addmm, "CPU")
    _LIB.append(lib)


def _wrap(original):
    @functools.wraps(original)
    def maybe_enable_batch_invariant_mode(self):
        from sglang.srt.runtime_context import get_exec

        if get_exec().deterministic.enable_deterministic_inference and not torch.cuda.is_available():
            enable_cpu_batch_invariant_mode()
            return None
        return original(self)

    maybe_enable_batch_invariant_mode._sglang_ext_patched = True
    return maybe_enable_batch_invariant_mode


def apply() -> None:
    if torch.cuda.is_available():
        return
    from sglang.srt.arg_groups import choices
    from sglang.srt.model_executor.model_runner import ModelRunner

    for allowed in (choices.DETERMINISTIC_ATTENTION_BACKEND_CHOICES,
                    choices.RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND):
        if CPU_BACKEND not in allowed:
            allowed.append(CPU_BACKEND)
    if not getattr(ModelRunner.maybe_enable_batch_invariant_mode, "_sglang_ext_patched", False):
        ModelRunner.maybe_enable_batch_invariant_mode = _wrap(ModelRunner.maybe_enable_batch_invariant_mode)
