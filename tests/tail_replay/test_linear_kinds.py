"""The registry of linear-layer kinds (`sglang_ext.tail_replay.linear_kinds`): GDN and Mamba-2 each
provide every field of the spec, on SGLang 0.5.23's real classes; every kind's bound hook bounds
its own naive twin's replay error; and a third kind, defined and registered inside a test, is
picked up by the bound patch (`patches/tail_replay/linear_bound.py`: its gates summed into the
requests' records) and by LinearKV's start-up check with no edit elsewhere."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from sglang_ext import patches

patches.apply_patches("cpu")  # before any SGLang import

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hybrid_kernels.gdn import state_from_sglang  # noqa: E402
from sglang_ext.linearkv.model_layers import scalar_decays_only  # noqa: E402
from sglang_ext.patches.tail_replay import batch as tail_batch  # noqa: E402
from sglang_ext.patches.tail_replay import linear_bound  # noqa: E402
from sglang_ext.tail_replay import (  # noqa: E402
    BoundHook,
    Gates,
    GateSeam,
    LinearKind,
    NaiveTwin,
    Scope,
    StateLayout,
    TailDecay,
    TwinTail,
    bound_segments,
    linear_kind,
    linear_kinds,
    linear_seam_owner,
    linear_seam_targets,
    register_linear_kind,
    summarize,
    unregister_linear_kind,
)

RTOL = 1e-4


def _hook_bounds_twin(kind: LinearKind, seed: int, tokens: int = 24, heads: int = 3) -> None:
    """||S_exact - S_replayed|| <= exp(sum of the hook's log-decay) ||S0|| per head, on the twin;
    an equality for a kind whose transition is a scalar decay."""
    gen = torch.Generator().manual_seed(seed)
    tail = kind.twin.random_tail(gen, tokens, heads)
    start = torch.randn(tail.state_shape, generator=gen)
    exact = kind.twin.replay(tail.inputs, start)
    replayed = kind.twin.replay(tail.inputs, torch.zeros_like(start))
    err = (exact - replayed).flatten(1).norm(dim=1)
    log_decay = kind.hook.log_decay(tail.gates.values.reshape(-1, heads), tail.gates.params)
    assert log_decay.shape == (tokens, heads) and log_decay.dtype == torch.float32
    assert torch.all(log_decay <= 0)
    allowed = log_decay.sum(0).exp() * start.flatten(1).norm(dim=1)
    assert torch.all(err <= allowed * (1 + RTOL) + 1e-6), (kind.name, err, allowed)
    assert err.max() > 0
    if kind.scalar_decay:
        torch.testing.assert_close(err, allowed, rtol=1e-4, atol=1e-6)


def test_gdn_and_mamba2_are_registered_and_provide_every_field():
    assert [kind.name for kind in linear_kinds()][:2] == ["gdn", "mamba2"]
    for name in ("gdn", "mamba2"):
        kind = linear_kind(name)
        for f in dataclasses.fields(kind):
            value = getattr(kind, f.name)
            assert value is not None and value != (), (name, f.name)
        for path in kind.layer_classes:
            owner, attr = linear_seam_owner(path)
            assert inspect.isclass(getattr(owner, attr)), path     # SGLang 0.5.23 has the class
        for seam in kind.seams:
            owner, attr = linear_seam_owner(seam.target)
            assert getattr(getattr(owner, attr), linear_bound.MARK, False), seam.target   # wrapped once
        assert callable(kind.hook.log_decay) and callable(kind.hook.heads)
        assert callable(kind.twin.replay) and callable(kind.twin.random_tail)
        assert kind.state.temporal[0] == "heads" and len(kind.state.temporal) == 3 and kind.state.conv
    assert linear_kind("mamba2").scalar_decay and not linear_kind("gdn").scalar_decay
    # one wrapper per SGLang target, however many kinds go through it
    assert len(set(linear_seam_targets())) == len(linear_seam_targets()) == 3


def test_state_layouts_match_the_twins_conventions():
    pool = torch.randn(4, 2, 5, 3)                         # [slots, heads, dv, dk] in SGLang's pool
    assert torch.equal(linear_kind("gdn").state.to_twin(pool), state_from_sglang(pool))
    assert torch.equal(linear_kind("gdn").state.to_pool(linear_kind("gdn").state.to_twin(pool)), pool)
    assert torch.equal(linear_kind("mamba2").state.to_twin(pool), pool)   # Mamba-2: the pool's layout


@pytest.mark.parametrize("name", ["gdn", "mamba2"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_kinds_hook_bounds_its_naive_twin(name, seed):
    _hook_bounds_twin(linear_kind(name), seed)


def test_a_kind_must_give_a_scope_and_gates():
    with pytest.raises(ValueError, match="neither"):
        GateSeam("m:f")
    with pytest.raises(ValueError, match="module:Attr"):
        GateSeam("no_colon", scope=lambda a, k: None)
    with pytest.raises(ValueError, match="reordered"):
        StateLayout(conv=("c", "w"), temporal=("heads", "a", "b"), twin=("heads", "a", "c"))
    with pytest.raises(ValueError, match="already registered"):
        register_linear_kind(dataclasses.replace(linear_kind("gdn")))


# --- a third kind, one definition and one registration -------------------------------------------
# A scalar-gated linear attention (RetNet / "simple GLA" style): per head
# S_t = exp(g_t) S_{t-1} + k_t v_t^T, g_t = -exp(A_log) sigmoid(gate_t), its layer a mixer whose
# forward sees the packed batch's gates. Its stand-in SGLang module is made here.

class ToyMixer(torch.nn.Module):
    def __init__(self, layer_id: int, heads: int):
        super().__init__()
        self.layer_id = layer_id
        self.A_log = torch.nn.Parameter(torch.linspace(-1.0, 0.5, heads))

    def forward(self, forward_batch: Any, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return x * 2


def _toy_log_decay(rows: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    return -params["A_log"].float().exp() * torch.sigmoid(rows.float())


def _toy_replay(inputs: Mapping[str, torch.Tensor], state: torch.Tensor) -> torch.Tensor:
    state = state.float()
    for g, k, v in zip(inputs["g"], inputs["k"], inputs["v"]):
        state = g.exp()[:, None, None] * state + k[:, :, None] * v[:, None, :]
    return state


def _toy_random_tail(gen: torch.Generator, tokens: int, heads: int) -> TwinTail:
    gate = torch.randn(tokens, heads, generator=gen)
    params = {"A_log": torch.randn(heads, generator=gen) * 0.3 - 1.5}
    inputs = {"g": _toy_log_decay(gate, params), "k": F.normalize(torch.randn(tokens, heads, 4, generator=gen), dim=-1),
              "v": torch.randn(tokens, heads, 5, generator=gen)}
    return TwinTail(inputs, Gates(gate, params), (heads, 4, 5))


def _toy_kind(module: str) -> LinearKind:
    return LinearKind(
        name="toy",
        layer_classes=(f"{module}:ToyMixer",),
        seams=(GateSeam(f"{module}:ToyMixer.forward",
                        scope=lambda args, kwargs: Scope(args[1], args[0].layer_id, args[0]),
                        gates=lambda args, kwargs, layer: Gates(args[3], {"A_log": layer.A_log.detach()})),),
        hook=BoundHook(log_decay=_toy_log_decay, heads=lambda params: int(params["A_log"].numel())),
        state=StateLayout(conv=("conv_dim", "window"), temporal=("heads", "dv", "dk"), twin=("heads", "dk", "dv")),
        twin=NaiveTwin(replay=_toy_replay, random_tail=_toy_random_tail),
        scalar_decay=True,
    )


@pytest.fixture
def toy_module(monkeypatch):
    module = types.ModuleType("toy_sglang_layers")
    module.ToyMixer = ToyMixer
    monkeypatch.setitem(sys.modules, module.__name__, module)
    original = ToyMixer.forward
    yield module.__name__
    unregister_linear_kind("toy")
    ToyMixer.forward = original


def _extend_batch(extend_lens: list[int], segments: Any) -> SimpleNamespace:
    mode = SimpleNamespace(is_extend=lambda: True, is_target_verify=lambda: False)
    fb = SimpleNamespace(forward_mode=mode, extend_seq_lens_cpu=list(extend_lens))
    tail_batch._remember(tail_batch._batch_keys(fb), None, None, None, segments, None)
    return fb


def test_a_registered_third_kind_is_bounded_with_no_edit_elsewhere(toy_module):
    kind = register_linear_kind(_toy_kind(toy_module))
    _hook_bounds_twin(kind, seed=3)                        # its own hook bounds its own twin
    linear_bound.apply()                                   # what every process runs at start-up
    assert getattr(ToyMixer.forward, linear_bound.MARK, False)
    linear_bound.apply()                                   # idempotent
    assert not getattr(ToyMixer.forward.__wrapped__, linear_bound.MARK, False)

    # two requests in one packed extend batch: request 0 replays tail [2, 6) of its 8 rows,
    # request 1 (5 rows, prefix 3) replays [3, 7); gates of the whole batch [13, heads]
    heads, mixers = 3, [ToyMixer(layer_id, 3) for layer_id in (4, 9)]
    decays = (TailDecay(), TailDecay())
    segments = bound_segments([(decays[0], 2, 6), (decays[1], 3, 7)], prefix_lens=[0, 3], extend_lens=[8, 5])
    fb = _extend_batch([8, 5], segments)
    gates = torch.randn(13, heads)
    for mixer in mixers:
        assert torch.equal(mixer(fb, torch.ones(2), gates), torch.full((2,), 2.0))   # the layer's own result
    for mixer in mixers:
        params = {"A_log": mixer.A_log.detach()}
        torch.testing.assert_close(decays[0].sums[mixer.layer_id], _toy_log_decay(gates[2:6], params).sum(0))
        torch.testing.assert_close(decays[1].sums[mixer.layer_id], _toy_log_decay(gates[8:12], params).sum(0))
    assert decays[0].tokens == {4: 4, 9: 4} and decays[1].tokens == {4: 4, 9: 4}
    bound = summarize(decays[0], replayed_tokens=4)
    assert bound is not None and len(bound.per_layer) == 2 and 0 < bound.state_bound < 1

    # a batch without approximate tails, and a decode, add nothing
    mixers[0](_extend_batch([4], None), torch.ones(1), torch.randn(4, heads))
    decode = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: False, is_target_verify=lambda: False),
                             extend_seq_lens_cpu=[1])
    mixers[0](decode, torch.ones(1), torch.randn(1, heads))
    assert decays[0].tokens == {4: 4, 9: 4} and decays[1].tokens == {4: 4, 9: 4}

    # LinearKV's start-up reads the same registry: a model of toy mixers composes chunk by chunk
    assert scalar_decays_only(torch.nn.Sequential(*mixers))
    unregister_linear_kind("toy")
    assert not scalar_decays_only(torch.nn.Sequential(*mixers))   # no registered kind: no linear layer
    mixers[0](fb, torch.ones(2), gates)                            # the seam passes an unregistered kind through
    assert decays[0].tokens == {4: 4, 9: 4}


def test_the_seam_calls_straight_through_while_no_batch_has_a_row_to_bound(toy_module, monkeypatch):
    """Misses and exact hits only (no approximate tail, no carried row in any batch in flight):
    the wrapper neither opens a scope nor reads the registry; once a batch with a tail is
    remembered it does, and after that batch is evicted from the memo it no longer does."""
    register_linear_kind(_toy_kind(toy_module))
    linear_bound.apply()
    monkeypatch.setattr(tail_batch, "_TAIL_BY_BATCH", type(tail_batch._TAIL_BY_BATCH)())
    monkeypatch.setattr(tail_batch, "_bounded_entries", 0)
    for lens in ([4], [6], [3]):
        _extend_batch(lens, None)
    assert not tail_batch.any_bound_rows()
    hooked = []
    monkeypatch.setattr(linear_bound, "_hook", lambda target, args, kwargs: hooked.append(target))
    mixer = ToyMixer(4, 3)
    mixer(_extend_batch([4], None), torch.ones(1), torch.randn(4, 3))
    assert hooked == []
    decay = TailDecay()
    _extend_batch([5], bound_segments([(decay, 1, 4)], prefix_lens=[0], extend_lens=[5]))
    assert tail_batch.any_bound_rows()
    mixer(_extend_batch([4], None), torch.ones(1), torch.randn(4, 3))
    assert len(hooked) == 1
    for n in range(2 * tail_batch._MAX_BATCHES_IN_FLIGHT + 1):   # the tail's batch leaves the memo
        _extend_batch([7 + n], None)
    assert not tail_batch.any_bound_rows() and tail_batch._bounded_entries == 0


def test_within_a_forward_the_seam_follows_that_forwards_batch_alone(toy_module, monkeypatch):
    """`patches/tail_replay/forward_scope.py`: inside a `ModelRunner.forward` call, a batch without
    rows to bound calls straight through even while another remembered batch has a tail (an exact
    hit right after an approximate replay), and a batch with a tail is hooked; outside a forward
    the seam keeps its own test."""
    from sglang_ext.patches.tail_replay import forward_scope

    register_linear_kind(_toy_kind(toy_module))
    linear_bound.apply()
    monkeypatch.setattr(tail_batch, "_TAIL_BY_BATCH", type(tail_batch._TAIL_BY_BATCH)())
    monkeypatch.setattr(tail_batch, "_bounded_entries", 0)
    hooked = []
    monkeypatch.setattr(linear_bound, "_hook", lambda target, args, kwargs: hooked.append(target))
    mixer = ToyMixer(4, 3)
    tailed = _extend_batch([5], bound_segments([(TailDecay(), 1, 4)], prefix_lens=[0], extend_lens=[5]))
    plain = _extend_batch([4], None)
    assert tail_batch.any_bound_rows()

    class Runner:
        def forward(self, forward_batch, rows):
            return mixer(forward_batch, torch.ones(1), torch.randn(rows, 3))

    run = forward_scope._wrap_forward(Runner.forward)
    run(Runner(), plain, 4)
    assert hooked == [] and forward_scope.forward_bound_rows() is None   # reset after the call
    run(Runner(), tailed, 5)
    assert len(hooked) == 1
    mixer(plain, torch.ones(1), torch.randn(4, 3))   # outside a forward: any remembered tail counts
    assert len(hooked) == 2
