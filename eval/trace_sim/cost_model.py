"""Prefill cost model: ``ttft(new, cached) = a + b*new + c*new*(cached + new/2)``.

``a`` is fixed overhead, ``b`` the per-token (MLP/projection) cost and ``c`` the
attention cost per (query, key) pair: each of the ``new`` tokens attends to the
``cached`` prefix and, on average, to half of the new tokens. Parameters come from a
JSON file whose ``source`` says whether they were measured (``calibrate.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_COST_MODEL = Path(__file__).with_name("cost_model.json")


@dataclass(frozen=True)
class PrefillCostModel:
    a: float
    b: float
    c: float
    source: str = "unspecified"

    def ttft(self, new_tokens: float, cached_tokens: float) -> float:
        if new_tokens <= 0:
            return self.a
        return self.a + self.b * new_tokens + self.c * new_tokens * (cached_tokens + new_tokens / 2)

    def segment_cost(self, start_token: float, n_tokens: float) -> float:
        """Seconds to compute ``n_tokens`` that follow ``start_token`` cached tokens."""
        return self.b * n_tokens + self.c * n_tokens * (start_token + n_tokens / 2)


def load_cost_model(path: Path = DEFAULT_COST_MODEL) -> PrefillCostModel:
    data = json.loads(Path(path).read_text())
    params = data["params"]
    return PrefillCostModel(a=float(params["a"]), b=float(params["b"]), c=float(params["c"]),
                            source=str(data["source"]))


def design_matrix(new_tokens, cached_tokens) -> np.ndarray:
    new = np.asarray(new_tokens, dtype=float)
    cached = np.asarray(cached_tokens, dtype=float)
    return np.stack([np.ones_like(new), new, new * (cached + new / 2)], axis=1)


def fit_cost_model(new_tokens, cached_tokens, ttft_s, source: str) -> PrefillCostModel:
    """Least-squares fit of (a, b, c) to measured TTFTs; negative terms are clipped to 0
    by refitting without them (non-negative least squares over 3 columns)."""
    x = design_matrix(new_tokens, cached_tokens)
    y = np.asarray(ttft_s, dtype=float)
    coef = _nonnegative_lstsq(x, y)
    return PrefillCostModel(a=float(coef[0]), b=float(coef[1]), c=float(coef[2]), source=source)


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda i: coef[i]))


def save_cost_model(model: PrefillCostModel, path: Path, extra: dict | None = None) -> None:
    data = {"source": model.source,
            "formula": "ttft = a + b*new + c*new*(cached + new/2)  [seconds, tokens]",
            "params": {"a": model.a, "b": model.b, "c": model.c}}
    data.update(extra or {})
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
