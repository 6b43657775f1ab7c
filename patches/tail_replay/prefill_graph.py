"""Exact-KV Tail-Replay under SGLang's "full" prefill CUDA graph: batches with a tail run eagerly.

Target (SGLang 0.5.23): `srt/model_executor/runner/prefill_cuda_graph_runner.py:
PrefillCudaGraphRunner.can_run_graph`. A full prefill graph (`--cuda-graph-config` prefill backend
"full", opt-in) replays the whole forward with no Python in between, so the exact-KV substitution
(`patches/tail_replay/attention.py`) cannot run at replay. An extend batch holding a replayed tail
whose KV must come from the tree is therefore not replayed from that graph: `can_run_graph` says no
and SGLang runs it eagerly (its ordinary fallback for batches a graph cannot take). The breakable
backend (the CUDA default) keeps its graphs: its eager attention region substitutes at replay.
Batches without such a tail are untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from sglang_ext.patches.tail_replay.batch import tail_of

TARGET = "srt/model_executor/runner/prefill_cuda_graph_runner.py: PrefillCudaGraphRunner.can_run_graph"


def _wrap_can_run_graph(original: Callable) -> Callable:
    @functools.wraps(original)
    def can_run_graph(self, forward_batch) -> bool:
        if getattr(self, "_is_full_backend", False) and tail_of(forward_batch) is not None:
            return False
        return original(self, forward_batch)

    can_run_graph.sglang_ext_tail_replay = True
    return can_run_graph


def apply() -> None:
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    if not getattr(PrefillCudaGraphRunner.can_run_graph, "sglang_ext_tail_replay", False):
        PrefillCudaGraphRunner.can_run_graph = _wrap_can_run_graph(PrefillCudaGraphRunner.can_run_graph)
