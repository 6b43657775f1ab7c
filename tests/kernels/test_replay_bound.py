"""The replay error bound (hybrid_kernels.replay_bound) against the measured state error:
||S_exact(L) - S_replayed(L)|| <= bound x ||S_exact(L - W)|| per layer and head, for GDN and
Mamba-2, on random gates and on the gates of the project's two trained models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybrid_kernels.gdn.naive import gdn_recurrent_ref, l2norm
from hybrid_kernels.mamba2.naive import ssd_step_ref
from hybrid_kernels.replay_bound import gdn_replay_bound, mamba2_replay_bound

ROOT = Path(__file__).resolve().parents[2]
RTOL = 1e-4


def _gdn_states(k, v, g, beta, cut):
    """(S(cut) exact, S(T) exact, S(T) replayed from zero at cut) for one head-batched sequence."""
    T, H, dk = k.shape
    zero = torch.zeros(H, dk, v.shape[-1])
    q = torch.zeros_like(k)
    _, s_cut = gdn_recurrent_ref(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], zero)
    _, s_exact = gdn_recurrent_ref(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], s_cut)
    _, s_replay = gdn_recurrent_ref(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], zero)
    return s_cut, s_exact, s_replay


def _check_gdn(k, v, g, beta, window):
    cut = k.shape[0] - window
    s_cut, s_exact, s_replay = _gdn_states(k, v, g, beta, cut)
    err = (s_exact - s_replay).flatten(1).norm(dim=1)
    allowed = gdn_replay_bound(g[cut:]) * s_cut.flatten(1).norm(dim=1)
    assert torch.all(err <= allowed * (1 + RTOL) + 1e-6), (err, allowed)
    return err, allowed


@pytest.mark.parametrize("seed,window", [(0, 1), (1, 7), (2, 33), (3, 64)])
def test_gdn_bound_holds_on_random_gates(seed, window):
    gen = torch.Generator().manual_seed(seed)
    T, H, dk, dv = 80, 4, 8, 6
    k = l2norm(torch.randn(T, H, dk, generator=gen))
    v = torch.randn(T, H, dv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(T, H, generator=gen)) * torch.tensor([0.001, 0.01, 0.1, 1.0])
    beta = torch.rand(T, H, generator=gen) * 2.0          # the bound holds for beta in [0, 2]
    err, allowed = _check_gdn(k, v, g, beta, window)
    assert err.max() > 0                                   # a real error was measured


def test_gdn_bound_is_tight_when_keys_are_orthogonal_to_the_state():
    """beta = 0: M_tail = exp(sum g) I exactly, so the error equals the bound."""
    T, H, dk, dv = 20, 2, 4, 3
    k = l2norm(torch.randn(T, H, dk))
    v = torch.randn(T, H, dv)
    g = torch.full((T, H), -0.05)
    beta = torch.zeros(T, H)
    beta[:10] = 0.7                                        # writes before the cut only
    err, allowed = _check_gdn(k, v, g, beta, 10)
    assert err == pytest.approx(allowed, rel=1e-5)


@pytest.mark.parametrize("seed,window", [(0, 1), (1, 16), (2, 50)])
def test_mamba2_error_equals_the_bound_on_random_gates(seed, window):
    gen = torch.Generator().manual_seed(seed)
    T, H, P, N = 70, 3, 4, 5
    A = -torch.tensor([0.01, 0.3, 2.0])
    dt = torch.nn.functional.softplus(torch.randn(T, H, generator=gen))
    x, B = torch.randn(T, H, P, generator=gen), torch.randn(T, H, N, generator=gen)
    _check_mamba2(x, dt, A, B, window)


def _mamba2_run(x, dt, A, B, h):
    C = torch.zeros(B.shape[1], B.shape[2])
    for t in range(x.shape[0]):
        _, h = ssd_step_ref(h, x[t], dt[t][:, None].expand_as(x[t]), A[:, None, None], B[t], C)
    return h


def _check_mamba2(x, dt, A, B, window):
    T, H, P = x.shape
    cut = T - window
    zero = torch.zeros(H, P, B.shape[-1])
    h_cut = _mamba2_run(x[:cut], dt[:cut], A, B[:cut], zero)
    err = (_mamba2_run(x[cut:], dt[cut:], A, B[cut:], h_cut) - _mamba2_run(x[cut:], dt[cut:], A, B[cut:], zero))
    err = err.flatten(1).norm(dim=1)
    allowed = mamba2_replay_bound(dt[cut:], A) * h_cut.flatten(1).norm(dim=1)
    assert torch.all(err <= allowed * (1 + RTOL) + 1e-6), (err, allowed)
    assert err == pytest.approx(allowed, rel=1e-3, abs=1e-6)   # Mamba-2: an equality


def _held_out_ids(model_dir: Path, n: int) -> torch.Tensor:
    from tokenizers import Tokenizer

    from eval import corpus

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(" ".join(corpus.essay_sentences("eval")[:80])).ids
    assert len(ids) >= n
    return torch.tensor([ids[:n]])


def test_gdn_bound_holds_on_the_trained_models_gates(monkeypatch):
    """Every GDN layer of trained_models/gdn-ruler, on held-out text: its own k, v, g, beta."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    model_dir = ROOT / "trained_models" / "gdn-ruler"
    captured = []
    original = m.torch_chunk_gated_delta_rule

    def capture(query, key, value, g, beta, **kwargs):
        captured.append((key[0].detach(), value[0].detach(), g[0].detach(), beta[0].detach()))
        return original(query, key, value, g=g, beta=beta, **kwargs)

    monkeypatch.setattr(m, "torch_chunk_gated_delta_rule", capture)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        model(_held_out_ids(model_dir, 160))
    assert len(captured) == sum(t == "linear_attention" for t in model.config.layer_types)
    for key, value, g, beta in captured:
        for window in (2, 8, 32):
            _check_gdn(l2norm(key.float()), value.float(), g.float(), beta.float(), window)


def test_mamba2_bound_holds_on_the_trained_models_gates():
    """Every Mamba-2 layer of trained_models/mamba2-ruler: its learned dt and A on held-out text
    (inputs x, B random: the error does not depend on them)."""
    from transformers import AutoModelForCausalLM

    from eval.training.decay import collect_log_decay

    model_dir = ROOT / "trained_models" / "mamba2-ruler"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        log_decay = collect_log_decay(model, [_held_out_ids(model_dir, 160)[0].tolist()])
    assert log_decay
    gen = torch.Generator().manual_seed(0)
    for layer, per_token in log_decay.items():                # [tokens, heads] = dt * A
        A = -model.model.layers[layer].mixer.A_log.float().exp().detach()
        dt = per_token / A
        T, H = dt.shape
        x, B = torch.randn(T, H, 3, generator=gen), torch.randn(T, H, 4, generator=gen)
        for window in (2, 16, 64):
            _check_mamba2(x, dt, A, B, window)
