"""What the servers' and the router's Prometheus endpoints (`/metrics`) tell a replay: the
repair runs a server sent itself, the prompt tokens each worker served, the router's counters."""

from __future__ import annotations

import re

import requests

from eval.replay.router import RouterCounters

_PROMPT_TOKENS = re.compile(r"^sglang:prompt_tokens_total\{[^}]*\} (\S+)$", re.M)
_REPAIRS = re.compile(r'^sglang_ext:tail_replay_repairs_total\{[^}]*kind="([^"]+)"[^}]*\} (\S+)$', re.M)


def background_runs(metrics_texts: list[str]) -> dict[str, int]:
    """Exact repair runs the servers sent themselves and finished by now, by kind, summed over
    workers (`sglang_ext:tail_replay_repairs_total`; none on stock SGLang): work beside the
    replayed traffic that its TTFTs pay for."""
    runs: dict[str, int] = {}
    for text in metrics_texts:
        for kind, value in _REPAIRS.findall(text):
            runs[f"repair {kind}"] = runs.get(f"repair {kind}", 0) + int(float(value))
    return {k: v for k, v in sorted(runs.items()) if v}


def router_counters(url: str) -> RouterCounters:
    """The router's counters now (its Prometheus endpoint `url`)."""
    resp = requests.get(url, timeout=60)
    resp.raise_for_status()
    return RouterCounters.parse(resp.text)


def prompt_tokens_served(url: str) -> int:
    """Prompt tokens a worker has served (its `/metrics`; the CPU launcher turns metrics on),
    warm-up included: how the router spread the replay."""
    resp = requests.get(f"{url}/metrics", timeout=60)
    resp.raise_for_status()
    return int(sum(float(v) for v in _PROMPT_TOKENS.findall(resp.text)))


def server_pools(url: str) -> dict[str, int | None]:
    """The pools a server (one worker) actually holds, from its `/server_info`: KV tokens
    (`memory_usage.token_capacity`: SGLang caps --max-total-tokens at what memory allows), state
    slots (`max_mamba_cache_size`, resolved) and running requests admitted at most; None where
    the server does not say."""
    resp = requests.get(f"{url}/server_info", timeout=60)
    resp.raise_for_status()
    states = resp.json().get("internal_states") or [{}]
    state = states[0] if isinstance(states, list) and states else {}

    def as_int(value: object) -> int | None:
        return int(value) if isinstance(value, (int, float)) else None

    return {"kv_tokens": as_int((state.get("memory_usage") or {}).get("token_capacity")),
            "state_slots": as_int(state.get("max_mamba_cache_size")),
            "max_running_requests": as_int(state.get("effective_max_running_requests_per_dp"))}
