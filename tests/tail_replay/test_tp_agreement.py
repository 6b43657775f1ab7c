"""Tensor-parallel ranks make the same bound decisions: two `gloo` ranks each hold half of the
linear layers' heads, as SGLang's attention-TP group shards them, and drive the gate hooks'
accumulators (`BoundSegments`, `CarrySegments`) over a packed batch in two prefill chunks with
`DistributedHeadShards`. Every rank then computes the same state bound, the same per-position
provenance bounds and the same plan, equal to one rank holding every head; without the group
the ranks disagree (what a rank would decide on its own shard). A LinearKV capture keeps its
rank's own heads (it is applied per head to this rank's state shard)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_ext.cluster import free_port
from sglang_ext.tail_replay.config import TailReplayConfig
from sglang_ext.tail_replay.planner import plan_replay
from sglang_ext.tail_replay.provenance.bounds import CarryBound, carried_bounds, carry_segments, counts_exact
from sglang_ext.tail_replay.provenance.forward import DistributedHeadShards, TailDecay, bound_segments, summarize

#: "gloo" (CPU tensors, the suite) or "nccl" (each rank's tensors on its own GPU:
#: scripts/gpu_tp_checks.sh)
BACKEND = os.environ.get("SGLANG_EXT_TP_CHECK_BACKEND", "gloo")
LAYERS = (3, 7)          # SGLang layer ids of the linear layers
HEADS = 6                # every rank's heads together
WORLD = 2
#: request A replays its tail [24, 64) approximately; B computes after an approximate checkpoint
#: at 10; C captures a chunk's decay for LinearKV; the batch runs in two prefill chunks
PREFIX = {"A": 16, "B": 10, "C": 0}
CHUNKS = ({"A": 30, "B": 17, "C": 20}, {"A": 18, "B": 11, "C": 13})


def _log_decay(seed: int = 0) -> torch.Tensor:
    """[layers, rows of both chunks, heads]: per-token log-decays, one head of each rank forgets
    slowly in some layer so the maxima sit on different ranks."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(sum(chunk.values()) for chunk in CHUNKS)
    values = -torch.rand(len(LAYERS), rows, HEADS, generator=gen) * 0.2
    values[0, :, 1] *= 0.01    # rank 0's head 1 barely forgets in the first layer
    values[1, :, 4] *= 0.02    # rank 1's head 4 in the second
    return values


def _decide(log_decay: torch.Tensor, shards) -> dict:
    """What one rank computes and decides from its heads' log-decays [layers, rows, its heads]."""
    tail, capture = TailDecay(), TailDecay(local_heads=True)
    carry = CarryBound(PREFIX["B"], math.log(1e-3))
    offset, done = 0, dict(PREFIX)
    for chunk in CHUNKS:
        prefix = [done[k] for k in "ABC"]
        extend = [chunk[k] for k in "ABC"]
        segments = bound_segments([(tail, 24, 64), None, (capture, 0, 33)], prefix, extend, shards)
        carries = carry_segments([None, carry, None], prefix, extend, shards)
        n = sum(extend)
        for i, layer in enumerate(LAYERS):
            rows = log_decay[i, offset:offset + n]
            segments.accumulate(layer, rows.index_select(0, segments.rows))
            carries.accumulate(layer, rows.index_select(0, carries.rows))
        offset += n
        done = {k: done[k] + chunk[k] for k in "ABC"}
    bound = summarize(tail, 40)
    config = TailReplayConfig.of(exactness="approximate", min_match_tokens=1, min_replay_tokens=1)
    return {
        "state_bound": bound.state_bound, "per_layer": bound.per_layer,
        "carried": carried_bounds(carry, 0, 38, 0.0),
        "counts_exact": counts_exact(bound.state_bound, 0.05),
        "plan": plan_replay(64, None, 1, config, (48, bound.state_bound)),
        "capture_heads": {layer: tuple(s.shape) for layer, s in capture.sums.items()},
    }


def _rank(rank: int, port: int, log_decay: torch.Tensor, shared: bool, out: dict) -> None:
    dist.init_process_group(BACKEND, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        heads = HEADS // WORLD
        local = log_decay[..., rank * heads:(rank + 1) * heads].contiguous()
        if BACKEND == "nccl":
            torch.cuda.set_device(rank)
            local = local.cuda()
        got = _decide(local, DistributedHeadShards(dist.group.WORLD, WORLD) if shared else None)
        got["carried"] = got["carried"].cpu()
        out[rank] = got
    finally:
        dist.destroy_process_group()


def _run_ranks(shared: bool) -> dict:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(free_port(), _log_decay(), shared, out), nprocs=WORLD, join=True)
        return dict(out)


@pytest.fixture(scope="module")
def gathered():
    return _run_ranks(shared=True)


def test_every_rank_decides_as_one_rank_holding_every_head(gathered):
    alone = _decide(_log_decay(), None)
    for rank in range(WORLD):
        got = gathered[rank]
        assert got["state_bound"] == alone["state_bound"] and got["per_layer"] == alone["per_layer"]
        assert torch.equal(got["carried"], alone["carried"])
        assert got["counts_exact"] == alone["counts_exact"] and got["plan"] == alone["plan"]
        assert got["capture_heads"] == {layer: (HEADS // WORLD,) for layer in LAYERS}   # its own shard
    assert alone["per_layer"][0] > 0.9 and alone["per_layer"][1] > 0.9   # the slow heads (ranks 0 and 1) set them


def test_without_the_group_the_ranks_disagree():
    """The failure the group prevents: each rank's max over its own heads."""
    apart = _run_ranks(shared=False)
    assert apart[0]["per_layer"] != apart[1]["per_layer"]
    assert not torch.equal(apart[0]["carried"], apart[1]["carried"])
