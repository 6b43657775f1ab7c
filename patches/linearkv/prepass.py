"""LinearKV, in the worker: EPIC's chunk heads recomputed in context before the scheduled extend.

Target (SGLang 0.5.23): `srt/managers/tp_worker.py::TpModelWorker.forward_batch_generation`. Before
the scheduled forward of an extend batch, the head spans of its assembled LinearKV requests
(selector `epic-k`, set at admission by the linearkv cache) run as extend forwards of their own
(`sglang_ext.linearkv.prepass.run_prepass`, whose docstring says how); after the scheduled forward
is launched, the assembled requests whose first forward read chunk states are marked so the cache
can unlock those chunks. Batches without such requests (every batch on another backend) pass
untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

TARGET = "srt/managers/tp_worker.py: TpModelWorker.forward_batch_generation"


def _wrap_forward_batch_generation(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward_batch_generation(self, batch=None, *args, **kwargs):
        from sglang_ext.linearkv import needs_worker

        if batch is None or not any(needs_worker(req) for req in batch.reqs):
            return original(self, batch, *args, **kwargs)
        from sglang_ext.linearkv.prepass import first_forward_readers, mark_reads_done, run_prepass

        readers = first_forward_readers(batch)
        run_prepass(self, batch)
        result = original(self, batch, *args, **kwargs)
        mark_reads_done(self.model_runner, readers)
        return result

    return forward_batch_generation


def apply() -> None:
    from sglang.srt.managers.tp_worker import TpModelWorker

    TpModelWorker.forward_batch_generation = _wrap_forward_batch_generation(TpModelWorker.forward_batch_generation)
