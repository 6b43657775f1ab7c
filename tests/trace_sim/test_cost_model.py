from __future__ import annotations

import json

import numpy as np
import pytest

from eval.trace_sim.cost_model import DEFAULT_COST_MODEL, PrefillCostModel, fit_cost_model, load_cost_model, save_cost_model


def test_fit_recovers_known_parameters():
    truth = PrefillCostModel(a=0.02, b=3e-5, c=4e-10)
    news, cached = np.meshgrid([64, 256, 1024, 4096], [0, 1024, 4096, 16384])
    news, cached = news.ravel(), cached.ravel()
    ttft = [truth.ttft(n, c) for n, c in zip(news, cached)]
    fit = fit_cost_model(news, cached, ttft, source="test")
    assert (fit.a, fit.b, fit.c) == pytest.approx((truth.a, truth.b, truth.c), rel=1e-6)


def test_fit_never_returns_negative_terms():
    fit = fit_cost_model([10, 20, 30, 40], [0, 0, 0, 0], [1.0, 0.9, 0.8, 0.7], source="test")
    assert min(fit.a, fit.b, fit.c) >= 0


def test_round_trip_and_committed_model_says_where_it_comes_from(tmp_path):
    model = PrefillCostModel(a=1.0, b=2.0, c=3.0, source="measured")
    save_cost_model(model, tmp_path / "m.json", {"points": []})
    assert load_cost_model(tmp_path / "m.json") == model
    committed = json.loads(DEFAULT_COST_MODEL.read_text())
    assert committed["source"].startswith("measured") and len(committed["points"]) >= 3


def test_segment_cost_adds_up_to_ttft():
    model = PrefillCostModel(a=0.0, b=1e-4, c=1e-8)
    whole = model.ttft(3000, 1000)
    parts = model.segment_cost(1000, 1000) + model.segment_cost(2000, 2000)
    assert parts == pytest.approx(whole)
