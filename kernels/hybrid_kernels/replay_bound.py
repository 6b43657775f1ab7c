"""How far a Tail-Replay state can be from the exact one: bounds from the replayed tail's gates.

Tail-Replay rebuilds a linear layer's state at L by running the tail [L - W, L) from a zero state
instead of from the exact state S(L - W). The recurrences are affine in the state, so the error
is the tail's transition applied to the state that was dropped:

- GDN: S(L) - S_replayed(L) = M_tail S(L - W), M_tail = prod_t exp(g_t)(I - beta_t k_t k_t^T).
  With ||k_t|| = 1 and 0 <= beta_t <= 2, ||I - beta_t k_t k_t^T||_2 <= 1, hence per head
  ||S(L) - S_replayed(L)||_F <= exp(sum_tail g_t) ||S(L - W)||_F.
- Mamba-2: h(L) - h_replayed(L) = exp(A sum_tail dt_t) h(L - W) per head (an equality).

The factor depends only on the tail's gates, so it can be computed during (or before) the replay.
"""

from __future__ import annotations

import torch


def gdn_replay_bound(g: torch.Tensor) -> torch.Tensor:
    """g [W, H] (log decay of the replayed tail, <= 0) -> [H] fp32 = exp(sum_t g_t): per head, the
    relative Frobenius error of the replayed state is at most this. W = 0 gives 1 (nothing replayed)."""
    return torch.exp(g.float().sum(0))


def mamba2_replay_bound(dt: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """dt [W, H] (discretized), A [H] (negative) -> [H] fp32 = exp(A sum_t dt_t): per head, the
    replayed state's error is exactly this times the dropped state h(L - W)."""
    return torch.exp(A.float() * dt.float().sum(0))
