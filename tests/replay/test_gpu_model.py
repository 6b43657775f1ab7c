"""Modeled GPU TTFT (eval/replay/gpu_model.py): exact FLOPs, bytes and seconds of a small case, the
calibration against the published full prefills, and the per-server summary with the CPU term."""

from __future__ import annotations

import math

import pytest

from eval.replay.gpu_model import (
    PUBLISHED,
    add_modeled_ttft,
    bytes_moved,
    calibration,
    ideal_seconds,
    modeled_lines,
    modeled_ttfts,
    prefill_flops,
)
from eval.replay.real_models import GPUS, MODELS, Gpu, RealModel

TOY = RealModel(name="toy", hf_id="-", kv_bytes_per_token=100, state_bytes_per_slot=1000, active_params=1e9,
                total_params=2e9, attn_layers=2, q_heads=4, head_dim=8, bytes_per_param=2, source="test")
TOY_GPU = Gpu("toy", peak_bf16_flops=1e12, hbm_bytes_per_s=1e9, source="test")


def test_small_case_exact():
    # prompt 10, reused 4: 6 tokens computed; attention pairs (10*11 - 4*5) / 2 = 45
    assert prefill_flops(TOY, 10, 4) == 2e9 * 6 + 4 * 2 * 4 * 8 * 45 == 12_000_011_520
    # weights min(2e9, 1e9 * 6) x 2 B; KV read of 10 tokens + written 6; state loaded and stored
    assert bytes_moved(TOY, 10, 4) == 4e9 + 16 * 100 + 2 * 1000 == 4_000_003_600
    assert ideal_seconds(TOY, TOY_GPU, 10, 4) == pytest.approx(0.01200001152 + 4.0000036, rel=1e-12)
    # a miss stores a state but loads none; one computed token reads 1e9 x 2 B of weights
    assert bytes_moved(TOY, 10, 0) == 4e9 + 20 * 100 + 1000
    assert bytes_moved(TOY, 10, 9) == 2e9 + 11 * 100 + 2000
    assert prefill_flops(TOY, 10, 10) == prefill_flops(TOY, 10, 9)   # SGLang computes the last token
    records = [{"ok": True, "prompt_tokens": 10, "cached_tokens": 4}, {"ok": False, "prompt_tokens": 10, "cached_tokens": 0}]
    assert modeled_ttfts(records, TOY, TOY_GPU, 0.5, 0.25) == [pytest.approx(4.01200361152 / 0.5 + 0.25, rel=1e-12)]
    # a replay at 1 token per 5-token block: the request is priced as 50 real tokens, 20 reused
    assert modeled_ttfts(records, TOY, TOY_GPU, 0.5, 0.0, token_scale=5) == [
        pytest.approx(ideal_seconds(TOY, TOY_GPU, 50, 20) / 0.5, rel=1e-12)]
    with pytest.raises(ValueError, match="must be > 0"):
        modeled_ttfts(records, TOY, TOY_GPU, 0.5, 0.0, token_scale=0)


def test_calibration_against_the_published_full_prefills():
    h100 = GPUS["h100-sxm"]
    assert (h100.peak_bf16_flops, h100.hbm_bytes_per_s) == (989.4e12, 3.35e12)
    n = 32768
    pairs = n * (n + 1) // 2
    # by hand: 2 A n + 4 La Hq d pairs; weights + KV read and written + one state stored
    small = (2 * 4e9 * n + 4 * 8 * 16 * 256 * pairs) / 989.4e12 + \
        (4e9 * 2 + 2 * n * 8 * 2 * 4 * 256 * 2 + MODELS["qwen3.5-4b"].state_bytes_per_slot) / 3.35e12
    large = (2 * 27e9 * n + 4 * 16 * 24 * 256 * pairs) / 989.4e12 + \
        (27e9 * 2 + 2 * n * 16 * 2 * 4 * 256 * 2 + MODELS["qwen3.6-27b"].state_bytes_per_slot) / 3.35e12
    cal = calibration()
    assert cal.efficiency == pytest.approx(math.sqrt(small / 0.786 * large / 3.605), rel=1e-12)
    assert cal.efficiency == pytest.approx(0.4916, abs=5e-4)
    (p4, p27) = cal.points
    assert (p4["published_s"], p27["published_s"]) == (0.786, 3.605) and len(PUBLISHED) == 2
    assert p4["modeled_s"] == pytest.approx(small / cal.efficiency, rel=1e-12)
    # log least squares: the two residuals cancel in log; each within 15 %
    assert math.log1p(p4["residual"]) + math.log1p(p27["residual"]) == pytest.approx(0, abs=1e-12)
    assert p4["residual"] == pytest.approx(-0.1223, abs=5e-4) and p27["residual"] == pytest.approx(0.1394, abs=5e-4)


def _row(label, scheduler_ms, outside=None):
    row = {"server": label, "ttft_s": {"mean": 0.1, "p50": 0.1, "p95": 0.2},
           "process_cpu_ms_per_request": {"sglang::scheduler": scheduler_ms}}
    if outside is not None:
        row["profile"] = {"ms_per_request": {"outside_forward": outside}}
    return row


def test_servers_get_modeled_ttft_with_cpu_beyond_the_baseline():
    records = [{"ok": True, "prompt_tokens": 4096, "cached_tokens": c} for c in (0, 2048, 4000)]
    rows = [_row("stock", 300.0), _row("tr", 331.0), _row("cheap", 250.0)]
    spec = add_modeled_ttft(rows, {r["server"]: records for r in rows}, "stock", "qwen3-next-80b-a3b", "h100-sxm")
    assert spec["gpu"] == "h100-sxm" and spec["model"] == "qwen3-next-80b-a3b" and spec["baseline"] == "stock"
    cal = calibration()
    base = sorted(ideal_seconds(MODELS["qwen3-next-80b-a3b"], GPUS["h100-sxm"], 4096, c) / cal.efficiency
                  for c in (0, 2048, 4000))
    stock, tr, cheap = (r["modeled_gpu_ttft_s"] for r in rows)
    assert stock["p50"] == pytest.approx(base[1]) and stock["mean"] == pytest.approx(sum(base) / 3)
    assert stock["p95"] == pytest.approx(base[1] + 0.9 * (base[2] - base[1]))
    assert tr["cpu_beyond_baseline_ms"] == pytest.approx(31.0) and tr["p50"] == pytest.approx(base[1] + 0.031)
    assert cheap["cpu_beyond_baseline_ms"] == 0.0 and cheap["p50"] == pytest.approx(base[1])   # never below 0
    assert tr["cpu_source"] == "scheduler process CPU"
    # py-spy's split outside the forward is preferred where every server has it
    prof = [_row("stock", 300.0, outside=20.0), _row("tr", 280.0, outside=26.5)]
    add_modeled_ttft(prof, {r["server"]: records for r in prof}, "stock", "qwen3-next-80b-a3b", "h100-sxm")
    assert prof[1]["modeled_gpu_ttft_s"]["cpu_beyond_baseline_ms"] == pytest.approx(6.5)
    assert prof[1]["modeled_gpu_ttft_s"]["cpu_source"] == "py-spy outside the forward"
    text = "\n".join(modeled_lines({"gpu_model": spec, "servers": rows}))
    assert "efficiency 0.492" in text and "qwen3.5-4b 0.786 s -> 0.690 s (-12.2 %)" in text
    assert f"| tr | 0.100 / 0.100 / 0.200 | {tr['mean']:.4f} / {tr['p50']:.4f} / {tr['p95']:.4f} | 31.0 " in text
