"""Modeled GPU TTFT per request: what each replayed request's first token would take on a named GPU
and real model, on paper (no SGLang, no HTTP). docs/gpu_ttft_model.md states every assumption.

Per request, with n its prompt tokens and c the tokens it reused (`cached_tokens`: SGLang's prefix
length, so a Tail-Replay request's replayed tail is among the n - c tokens it computed), both in the
trace's real tokens (the replayed counts x the trace's real tokens per replayed token):

    FLOPs = 2 A (n - c) + 4 La Hq d (n(n+1) - c(c+1)) / 2
    bytes = min(P, A (n - c)) b + (n + (n - c)) kv + (1 + [c > 0]) state
    TTFT  = (FLOPs / peak + bytes / HBM) / efficiency + CPU beyond the baseline server's

A: active matmul parameters, P: all of them, b: bytes per parameter, La Hq d: full-attention
layers x query heads x head dim (QK^T and PV over every earlier position, causal), kv / state:
the model's KV bytes per token and state bytes per slot (read the context's KV, write the computed
tokens'; store the end state and load the resumed one). `efficiency` is one number, fitted to
published full-prefill times (`PUBLISHED`) by least squares in log time; `calibration` gives it
and each point's residual. The CPU term: per request, what the server's scheduler spends outside
the forward beyond the baseline's (py-spy's split under --profile, else the scheduler process's
CPU), never below 0: Python a GPU does not hide.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from eval.replay.real_models import Gpu, RealModel, gpu, real_model

#: (model, prompt tokens, seconds): full prefills on an H100 SXM published in the Tail-Replay paper
#: (Qwen3.5-4B at ~32K tokens in 786 ms, Qwen3.6-27B in 3,605 ms)
PUBLISHED = (("qwen3.5-4b", 32768, 0.786), ("qwen3.6-27b", 32768, 3.605))
CALIBRATION_GPU = "h100-sxm"


def prefill_flops(model: RealModel, prompt: int, reused: int) -> float:
    """FLOPs of computing tokens [reused, prompt) with attention over the whole context."""
    reused = _reused(prompt, reused)
    pairs = (prompt * (prompt + 1) - reused * (reused + 1)) // 2
    return 2.0 * model.active_params * (prompt - reused) + 4.0 * model.attn_layers * model.q_heads * model.head_dim * pairs


def bytes_moved(model: RealModel, prompt: int, reused: int) -> float:
    """Weights, KV and state bytes the request's prefill moves through HBM."""
    reused = _reused(prompt, reused)
    computed = prompt - reused
    weights = min(model.total_params, model.active_params * computed) * model.bytes_per_param
    kv = (prompt + computed) * model.kv_bytes_per_token
    return weights + kv + (2 if reused > 0 else 1) * model.state_bytes_per_slot


def ideal_seconds(model: RealModel, device: Gpu, prompt: int, reused: int) -> float:
    """The prefill at 100 % of the GPU's peak FLOP/s and HBM bandwidth (the two added, not overlapped)."""
    return prefill_flops(model, prompt, reused) / device.peak_bf16_flops + bytes_moved(model, prompt, reused) / device.hbm_bytes_per_s


def _reused(prompt: int, reused: int) -> int:
    if prompt < 1:
        raise ValueError(f"a request has at least one prompt token, got {prompt}")
    return max(0, min(reused, prompt - 1))   # SGLang computes at least the last prompt token


@dataclass(frozen=True)
class Calibration:
    efficiency: float
    points: tuple[dict, ...]     # per published time: model, tokens, published_s, modeled_s, residual

    def as_dict(self) -> dict:
        return {"efficiency": self.efficiency, "gpu": CALIBRATION_GPU, "points": list(self.points)}


def calibration(published: Sequence[tuple[str, int, float]] = PUBLISHED) -> Calibration:
    """The one efficiency that fits the published full prefills best in log time (the geometric
    mean of ideal / published), and each point's residual (modeled / published - 1)."""
    device = gpu(CALIBRATION_GPU)
    ideal = [(name, n, t, ideal_seconds(real_model(name), device, n, 0)) for name, n, t in published]
    eff = math.exp(sum(math.log(i / t) for _, _, t, i in ideal) / len(ideal))
    points = tuple({"model": name, "tokens": n, "published_s": t, "modeled_s": i / eff, "residual": i / eff / t - 1}
                   for name, n, t, i in ideal)
    return Calibration(eff, points)


def scheduler_cpu_ms(row: dict) -> tuple[float | None, str]:
    """A server row's scheduler CPU per request outside the forward and where it comes from."""
    profile = row.get("profile") or {}
    if (profile.get("ms_per_request") or {}).get("outside_forward") is not None:
        return float(profile["ms_per_request"]["outside_forward"]), "py-spy outside the forward"
    cpu = (row.get("process_cpu_ms_per_request") or {}).get("sglang::scheduler")
    return (None, "not measured") if cpu is None else (float(cpu), "scheduler process CPU")


def modeled_ttfts(records: Sequence[dict], model: RealModel, device: Gpu, efficiency: float,
                  cpu_extra_s: float, token_scale: float = 1.0) -> list[float]:
    """Modeled TTFT (s) of each answered request; `token_scale`: real tokens per replayed token (a
    trace replayed at 1 token per 64-token block prices each request at 64x its replayed tokens)."""
    if not token_scale > 0:
        raise ValueError(f"real tokens per replayed token must be > 0, got {token_scale}")
    return [ideal_seconds(model, device, round(r["prompt_tokens"] * token_scale),
                          round(r["cached_tokens"] * token_scale)) / efficiency + cpu_extra_s
            for r in records if r["ok"]]


def add_modeled_ttft(rows: list[dict], per_server: dict[str, Sequence[dict]], baseline: str | None,
                     model_name: str, gpu_name: str, token_scale: float = 1.0) -> dict:
    """Give every row `modeled_gpu_ttft_s` (mean / p50 / p95 and the CPU term) and return the
    model's description for report.json (mutates `rows` only)."""
    from eval.replay.report import percentile

    model, device, cal = real_model(model_name), gpu(gpu_name), calibration()
    base_row = next((r for r in rows if r["server"] == baseline), None)
    base_cpu, base_source = scheduler_cpu_ms(base_row) if base_row else (None, "no baseline")
    for row in rows:
        cpu, source = scheduler_cpu_ms(row)
        same_source = base_row is not None and source == base_source
        extra_ms = max(0.0, cpu - base_cpu) if cpu is not None and base_cpu is not None and same_source else 0.0
        values = modeled_ttfts(per_server[row["server"]], model, device, cal.efficiency, extra_ms / 1e3, token_scale)
        row["modeled_gpu_ttft_s"] = None if not values else {
            "mean": sum(values) / len(values), "p50": percentile(values, 50), "p95": percentile(values, 95),
            "cpu_beyond_baseline_ms": extra_ms,
            "cpu_source": source if same_source and cpu is not None else f"{source}; baseline {base_source}"}
    return {"gpu": device.name, "gpu_source": device.source, "model": model.name, "model_source": model.source,
            "baseline": baseline, "real_tokens_per_replayed_token": token_scale, **cal.as_dict()}


def modeled_lines(report: dict) -> list[str]:
    """report.md's modeled-TTFT table beside the measured TTFTs (empty without a model)."""
    spec = report.get("gpu_model")
    if not spec:
        return []
    residuals = ", ".join(f"{p['model']} {p['published_s']:.3f} s -> {p['modeled_s']:.3f} s ({100 * p['residual']:+.1f} %)"
                          for p in spec["points"])
    lines = [f"Modeled GPU TTFT (on paper, docs/gpu_ttft_model.md): {spec['model']} on {spec['gpu']}, efficiency "
             f"{spec['efficiency']:.3f} fitted to published full prefills ({residuals}), each replayed token priced as "
             f"{spec.get('real_tokens_per_replayed_token', 1):g} real tokens, plus scheduler CPU per "
             f"request beyond {spec['baseline'] or '-'}'s.", "",
             "| server | measured TTFT mean / p50 / p95 s | modeled GPU TTFT mean / p50 / p95 s | CPU beyond baseline ms |",
             "|---|---:|---:|---:|"]
    for row in report["servers"]:
        m, t = row.get("modeled_gpu_ttft_s"), row.get("ttft_s")
        measured = "-" if t is None else f"{t['mean']:.3f} / {t['p50']:.3f} / {t['p95']:.3f}"
        modeled = "-" if m is None else f"{m['mean']:.4f} / {m['p50']:.4f} / {m['p95']:.4f}"
        cpu = "-" if m is None else f"{m['cpu_beyond_baseline_ms']:.1f} ({m['cpu_source']})"
        lines.append(f"| {row['server']} | {measured} | {modeled} | {cpu} |")
    return lines + [""]
