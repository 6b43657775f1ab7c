"""The CPU server's children forked from the launcher instead of spawned, when
`SGLANG_EXT_CPU_START_METHOD=fork` (`sglang_ext.env`; the default, "spawn", changes nothing).

Targets `srt/entrypoints/engine.py::_set_envs_and_config` (SGLang 0.5.23, ~line 1995), which
calls `mp.set_start_method("spawn", force=True)` on the module's `mp` (the stdlib
`multiprocessing`) before the scheduler and detokenizer processes start. Spawned children import
SGLang and re-apply the patches (`sglang_ext.spawn_main`), most of a tiny model's CPU start-up
(benchmarks/start_method.py). Forked children are copies of the launcher process,
which has imported SGLang and applied the patches already. Only the module's `mp` is replaced (by
a view of `multiprocessing` whose `set_start_method` picks fork), so nothing else in the process
changes its start method unless SGLang's own call sets the default. CUDA cannot be forked: the
launcher applies this in CPU mode only.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

from sglang_ext.env import TOKENIZERS_PARALLELISM_VAR, cpu_start_method

logger = logging.getLogger(__name__)

#: logged when SGLang's call picks fork through this seam
FORK_LOG = "sglang_ext: the server's children are forked from the launcher (SGLANG_EXT_CPU_START_METHOD=fork)"

TARGET = "srt/entrypoints/engine.py: _set_envs_and_config (mp.set_start_method('spawn', force=True))"


class ForkingMultiprocessing:
    """`multiprocessing`, except that `set_start_method` always picks fork."""

    def __getattr__(self, name: str):
        return getattr(multiprocessing, name)

    @staticmethod
    def set_start_method(method: str | None, force: bool = False) -> None:
        multiprocessing.set_start_method("fork", force=True)
        logger.info(FORK_LOG)


def apply() -> None:
    if cpu_start_method() != "fork":
        return
    from sglang.srt.entrypoints import engine

    if not isinstance(engine.mp, ForkingMultiprocessing):
        if engine.mp is not multiprocessing:
            raise RuntimeError(f"{__name__}: engine.mp is not the multiprocessing module; {TARGET} has changed")
        # the launcher has loaded a tokenizer before the fork: HF tokenizers' pool must stay off
        os.environ.setdefault(TOKENIZERS_PARALLELISM_VAR, "false")
        engine.mp = ForkingMultiprocessing()
