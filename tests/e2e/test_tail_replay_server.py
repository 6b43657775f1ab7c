"""Tail-Replay in the real patched server: token-level reuse without state checkpoints."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from eval.harness import ServerProcess, start_servers, stop_servers
from eval.reference import greedy_reference, load_reference_model, zero_state_reference
from tests.e2e.serving import assert_matches_reference, metric_total, random_prompt

L = 320              # shared prefix (document) length
SUFFIX = 40          # question tokens after the document
#: (`allow_request_audit_repair`: the audit and repair tests ask for them per request)
SERVER_CONFIG = {"budget": 1 / 16, "min_replay_tokens": 1, "min_match_tokens": 16, "allow_request_audit_repair": True}
#: per-request overrides (sampling_params.custom_params["tail_replay"]) on the same servers
OVERRIDES = {
    "w16": {},
    "w4": {"budget": 1 / 4},
    "wL": {"budget": 1.0},
    "w4_recompute": {"budget": 1 / 4, "kv_mode": "recompute"},
}


#: the Nemotron-H server runs without checkpoints: one state slot per running request
PURE_CONFIG = {**SERVER_CONFIG, "keep_checkpoints": False}
PURE_SLOTS = 4
PAGE = 16   # the paged server's --page-size
#: the paged server also audits every approximate answer (the live quality audit's sampled path)
PAGED_CONFIG = {**SERVER_CONFIG, "audit_rate": 1.0}


def _server_args(config: dict) -> list[str]:
    return ["--dtype", "float32", "--radix-cache-backend", "tail_replay",
            "--tail-replay-config", json.dumps(config), "--chunked-prefill-size", "64"]


@pytest.fixture(scope="module")
def servers(tiny_model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tail_replay_logs")
    pure_args = [*_server_args(PURE_CONFIG), "--max-mamba-cache-size", str(PURE_SLOTS),
                 "--max-running-requests", str(PURE_SLOTS)]
    # every server runs on one byte budget, Tail-Replay's default (SGLang's unified memory: one
    # byte buffer for KV and states, virtual slot ids), none passing the flag: every test below
    # reads its cached K/V through the id translation
    procs = {"qwen3-next": ServerProcess(str(tiny_model_factory("qwen3-next")),
                                         [*_server_args(SERVER_CONFIG), "--enable-streaming-session"],
                                         log_path=logs / "qwen3-next.log"),
             "nemotron-h": ServerProcess(str(tiny_model_factory("nemotron-h")), pure_args,
                                         log_path=logs / "nemotron-h.log"),
             "qwen3-next-paged": ServerProcess(
                 str(tiny_model_factory("qwen3-next")),
                 [*_server_args(PAGED_CONFIG), "--page-size", str(PAGE), "--mamba-radix-cache-strategy", "no_buffer"],
                 log_path=logs / "qwen3-next-paged.log")}
    start_servers(list(procs.values()))
    try:
        yield procs
    finally:
        stop_servers(list(procs.values()))


def ask(server, ids, overrides=None, **kwargs):
    custom = {"tail_replay": overrides} if overrides else None
    start = kwargs.pop("logprob_start_len", -1)
    return server.generate(input_ids=ids, sampling_params={"max_new_tokens": kwargs.pop("new_tokens", 6),
                                                           "temperature": 0, "custom_params": custom},
                           return_logprob=True, logprob_start_len=start)


@pytest.fixture(scope="module")
def hf_qwen(tiny_model_factory):
    return load_reference_model(tiny_model_factory("qwen3-next"))


def _details(result) -> dict:
    return result["meta_info"]["cached_tokens_details"]["tail_replay"]


def _plan_details(result) -> dict:
    """The plan's part of the summary (without the bounds and the exactness)."""
    return {k: v for k, v in _details(result).items() if k in ("kind", "matched_tokens", "reused_tokens",
                                                               "replayed_tokens")}


def _warm_then_ask(server, document, question, overrides=None, **kwargs):
    """Send the document with another suffix, then the real question. The warm-up stores no
    states (with 64-token chunked prefill it would leave exact checkpoints every 64 tokens,
    which the planner would rightly prefer), so the question's hit is a pure KV hit."""
    ask(server, document + random_prompt(5, seed=999), {"keep_checkpoints": False}, new_tokens=1)
    return ask(server, document + question, overrides, **kwargs)


@pytest.mark.parametrize("arch", ["qwen3-next", "nemotron-h"])
def test_shared_prefix_with_a_different_suffix_is_reused(servers, arch):
    # Stock SGLang reuses 0 tokens here (no state checkpoint at the branch point).
    document = random_prompt(L, seed=1)
    result = _warm_then_ask(servers[arch], document, random_prompt(SUFFIX, seed=2))
    window = max(1, -(-L // 16))
    assert result["meta_info"]["cached_tokens"] >= L - window
    assert _plan_details(result) == {"kind": "approximate", "matched_tokens": L,
                                     "reused_tokens": L - window, "replayed_tokens": window}
    assert 0 < _details(result)["state_bound"] <= 1


def test_paged_tree_replays_from_a_page_boundary(servers, hf_qwen):
    server = servers["qwen3-next-paged"]
    document = random_prompt(L, seed=50)
    result = _warm_then_ask(server, document, random_prompt(SUFFIX, seed=51))
    start = (L - L // 16) // PAGE * PAGE            # W = 20, cut to whole pages
    assert _plan_details(result) == {"kind": "approximate", "matched_tokens": L,
                                     "reused_tokens": start, "replayed_tokens": L - start}
    question = random_prompt(SUFFIX, seed=52)
    exact = ask(server, document + question, OVERRIDES["wL"])
    assert _details(exact)["kind"] == "exact_replay"
    assert_matches_reference(exact, greedy_reference(hf_qwen, document + question, 6))


def test_full_window_equals_full_prefill(servers, hf_qwen):
    document, question = random_prompt(L, seed=3), random_prompt(SUFFIX, seed=4)
    result = _warm_then_ask(servers["qwen3-next"], document, question, OVERRIDES["wL"])
    assert _details(result)["kind"] == "exact_replay" and _details(result)["matched_tokens"] == L
    assert "state_bound" not in _details(result)   # the state is exact: no bound to report
    assert_matches_reference(result, greedy_reference(hf_qwen, document + question, 6))


def _suffix_logprob_distance(server, overrides, reference, document, question) -> float:
    result = _warm_then_ask(server, document, question, overrides, logprob_start_len=L)
    assert _details(result)["matched_tokens"] == L
    served = torch.tensor([x[0] for x in result["meta_info"]["input_token_logprobs"][1:]])
    exact = torch.tensor(reference.input_logprobs[L:])
    return (served - exact).abs().mean().item()


def test_logprob_distance_shrinks_as_the_window_grows(servers, hf_qwen):
    document, question = random_prompt(L, seed=5), random_prompt(SUFFIX, seed=6)
    reference = greedy_reference(hf_qwen, document + question, 1)
    # No request here stores states, so no run can find another's checkpoint at depth L.
    distance = {name: _suffix_logprob_distance(servers["qwen3-next"], {**overrides, "keep_checkpoints": False},
                                               reference, document, question)
                for name, overrides in OVERRIDES.items()}
    print("mean |logprob - full prefill| over the question:", json.dumps(distance))
    assert distance["wL"] < 1e-4 < distance["w16"]
    assert distance["w4_recompute"] != distance["w4"]   # the tail's KV is recomputed, not copied
    assert distance["w4"] <= distance["w16"] + 1e-6
    assert distance["wL"] <= distance["w4"] + 1e-6


def test_recompute_mode_is_a_zero_state_replay_in_every_chunk_and_decode(servers, hf_qwen):
    """kv_mode "recompute": the request attends to its own recomputed tail KV in every prefill chunk
    (64-token chunks: the 160-token tail and the question span 4) and in every decode step, so it
    equals transformers with the linear state zeroed at the replay start. (SGLang's per-chunk
    publish used to switch the request's tail to the tree's exact KV after the first chunk: other
    tokens from the third on.) Concurrent recompute requests then leave the pools clean (the
    server's idle leak check)."""
    server = servers["qwen3-next"]
    document, question = random_prompt(L, seed=60), random_prompt(SUFFIX, seed=61)
    window = L // 2
    overrides = {"kv_mode": "recompute", "keep_checkpoints": False,
                 "min_replay_tokens": window, "max_replay_tokens": window}
    result = _warm_then_ask(server, document, question, overrides, new_tokens=8)
    assert _plan_details(result) == {"kind": "approximate", "matched_tokens": L,
                                     "reused_tokens": L - window, "replayed_tokens": window}
    assert_matches_reference(result, zero_state_reference(hf_qwen, document + question, L - window, 8))
    prompts = [document + random_prompt(SUFFIX, seed=62 + i) for i in range(4)]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        results = list(pool.map(lambda p: ask(server, p, overrides, new_tokens=4), prompts))
    assert {_details(r)["kind"] for r in results} == {"approximate"}
    requests.get(f"{server.url}/health_generate", timeout=60).raise_for_status()
    assert not re.search(r"leak|Traceback", server.log_text(), re.I)


#: the bound tests' window: the tail [240, 320) spans two 64-token prefill chunks ([240, 304), [304, 360))
BOUND_WINDOW = 80
BOUND_OVERRIDES = {"kv_mode": "recompute", "keep_checkpoints": False,
                   "min_replay_tokens": BOUND_WINDOW, "max_replay_tokens": BOUND_WINDOW}
LINEAR_MIXERS = ("Qwen3NextGatedDeltaNet", "NemotronHMamba2Mixer")


def _mixers(model) -> dict[int, torch.nn.Module]:
    """transformers' linear mixers by layer index (SGLang's layer id)."""
    return {int(name.split(".")[2]): mod for name, mod in model.named_modules()
            if type(mod).__name__ in LINEAR_MIXERS}


def _log_decay(mixer, x: torch.Tensor) -> torch.Tensor:
    """x [tokens, hidden] (the mixer's input) -> per-token log-decay [tokens, heads], from the
    mixer's own weights as transformers computes its gates (GDN: g; Mamba-2: A x dt)."""
    if hasattr(mixer, "in_proj_ba"):
        *_, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(x[None]), mixer.in_proj_ba(x[None]))
        g = -mixer.A_log.float().exp() * torch.nn.functional.softplus(a.float() + mixer.dt_bias)
        return g.reshape(x.shape[0], -1)
    dt = mixer.in_proj(x).split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], -1)[-1]
    step = torch.nn.functional.softplus(dt.float() + mixer.dt_bias).clamp(*mixer.time_step_limit)
    return -mixer.A_log.float().exp() * step


@torch.no_grad()
def _replay_states(model, ids: list[int], start: int, end: int, keep: int | None = None):
    """transformers, as kv_mode "recompute" replays: ids[:start] as a full prefill, then every
    linear layer's conv and recurrent state zeroed (layer `keep`'s recurrent state kept: the same
    layer inputs from the exact state at `start`), then ids[start:end]. Returns (recurrent state
    per linear layer at `start`, at `end`, each linear mixer's input rows of ids[start:end])."""
    mixers, inputs = _mixers(model), {}

    def capture(layer, module, args, kwargs):
        inputs[layer] = kwargs.get("hidden_states", args[0] if args else None)[0].clone()

    cache = model(torch.tensor([ids[:start]]), use_cache=True).past_key_values
    at_start = {i: cache.layers[i].recurrent_states[0].clone() for i in mixers}
    for i in mixers:
        cache.layers[i].conv_states[0].zero_()
        if i != keep:
            cache.layers[i].recurrent_states[0].zero_()
    hooks = [mixer.register_forward_pre_hook(lambda m, a, k, i=i: capture(i, m, a, k), with_kwargs=True)
             for i, mixer in mixers.items()]
    try:
        model(torch.tensor([ids[start:end]]), past_key_values=cache, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    return at_start, {i: cache.layers[i].recurrent_states[0].clone() for i in mixers}, inputs


def _heads(state: torch.Tensor) -> torch.Tensor:
    """[1, heads, a, b] -> per-head Frobenius norm [heads]."""
    return state[0].flatten(1).norm(dim=1)


@pytest.mark.parametrize("arch", ["qwen3-next", "nemotron-h"])
def test_reported_state_bound_is_the_replayed_tails_gate_decay(servers, tiny_model_factory, arch):
    """meta_info's state bound is exp(sum of the log-decay over the replayed tail) per layer (max
    over heads) and overall, as transformers computes the gates of the same replay from the model's
    weights (GDN: g; Mamba-2: A x dt), summed over the two prefill chunks the tail spans; and, per
    linear layer and head, the state error of dropping S(L - W) under the replay's inputs is within
    it: ||S(L) - S_replayed(L)|| <= bound x ||S(L - W)|| (for Mamba-2 an equality)."""
    document, question = random_prompt(L, seed=70), random_prompt(SUFFIX, seed=71)
    start = L - BOUND_WINDOW
    result = _warm_then_ask(servers[arch], document, question, BOUND_OVERRIDES, new_tokens=1)
    details = _details(result)
    assert _plan_details(result) == {"kind": "approximate", "matched_tokens": L,
                                     "reused_tokens": start, "replayed_tokens": BOUND_WINDOW}

    model = load_reference_model(tiny_model_factory(arch))
    mixers = _mixers(model)
    at_start, replayed, inputs = _replay_states(model, document + question, start, L)
    with torch.no_grad():
        per_head = {i: _log_decay(mixer, inputs[i]).sum(0).double().exp() for i, mixer in mixers.items()}
    expected = [per_head[i].max().item() for i in sorted(mixers)]
    print(arch, "state bound per layer:", details["state_bound_per_layer"], "offline:", expected)
    torch.testing.assert_close(torch.tensor(details["state_bound_per_layer"], dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), rtol=1e-3, atol=0)
    assert details["state_bound"] == max(details["state_bound_per_layer"])
    assert 1e-3 < details["state_bound"] < 1   # a window where the bound is neither 0 nor trivial

    for i, bound in zip(sorted(mixers), details["state_bound_per_layer"]):
        _, from_exact, _ = _replay_states(model, document + question, start, L, keep=i)
        error, dropped = _heads(from_exact[i] - replayed[i]), _heads(at_start[i])
        noise = 1e-5 * _heads(replayed[i]).max()
        assert (error <= bound * dropped * (1 + 1e-4) + noise).all(), (i, error, bound * dropped)
        assert (error <= per_head[i] * dropped * (1 + 1e-3) + noise).all(), (i, error, per_head[i] * dropped)
        if arch == "nemotron-h":   # Mamba-2: the error is exactly the factor times the dropped state
            torch.testing.assert_close(error.double(), per_head[i] * dropped.double(), rtol=1e-3, atol=noise.item())


def test_a_checkpoint_within_the_window_is_used_exactly(servers, hf_qwen):
    server = servers["qwen3-next"]
    first_ids = random_prompt(L, seed=7)
    first = ask(server, first_ids)
    follow_up = first_ids + first["output_ids"] + random_prompt(10, seed=8)
    second = ask(server, follow_up)
    assert _details(second)["kind"] == "exact_checkpoint"
    assert second["meta_info"]["cached_tokens"] >= L
    assert_matches_reference(second, greedy_reference(hf_qwen, follow_up, 6))


def test_metrics_count_matched_and_replayed_tokens(servers):
    server = servers["qwen3-next"]
    before = requests.get(f"{server.url}/metrics", timeout=30).text
    _warm_then_ask(server, random_prompt(L, seed=9), random_prompt(SUFFIX, seed=10), OVERRIDES["w4"])
    after = requests.get(f"{server.url}/metrics", timeout=30).text
    assert metric_total(after, "sglang_ext:tail_replay_matched_tokens_total") - \
        metric_total(before, "sglang_ext:tail_replay_matched_tokens_total") == L
    assert metric_total(after, "sglang_ext:tail_replay_replayed_tokens_total") - \
        metric_total(before, "sglang_ext:tail_replay_replayed_tokens_total") == L // 4
    approx = 'kind="approximate"'
    assert metric_total(after, "sglang_ext:tail_replay_hits_total", approx) > metric_total(
        before, "sglang_ext:tail_replay_hits_total", approx)


def test_state_bound_histogram_counts_each_approximate_hit_once(servers):
    server = servers["qwen3-next"]
    name = "sglang_ext:tail_replay_state_bound"
    before = requests.get(f"{server.url}/metrics", timeout=30).text
    result = _warm_then_ask(server, random_prompt(L, seed=72), random_prompt(SUFFIX, seed=73), OVERRIDES["w4"])
    exact = ask(server, random_prompt(L, seed=72) + random_prompt(SUFFIX, seed=74), OVERRIDES["wL"])
    after = requests.get(f"{server.url}/metrics", timeout=30).text
    bound = _details(result)["state_bound"]
    assert _details(exact)["kind"] == "exact_replay"      # not observed: no bound
    assert metric_total(after, f"{name}_count") - metric_total(before, f"{name}_count") == 1
    assert metric_total(after, f"{name}_sum") - metric_total(before, f"{name}_sum") == pytest.approx(bound, rel=1e-6)
    upper = min(le for le in (1e-9, 1e-6, 1e-4, 1e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0) if le >= bound)
    assert metric_total(after, f"{name}_bucket", f'le="{upper}"') - \
        metric_total(before, f"{name}_bucket", f'le="{upper}"') == 1


def test_without_checkpoints_a_continuation_is_replayed(servers):
    server, no_states = servers["qwen3-next"], {"keep_checkpoints": False}
    first_ids = random_prompt(L, seed=11)
    first = ask(server, first_ids, no_states)
    second = ask(server, first_ids + first["output_ids"] + random_prompt(10, seed=12), no_states)
    # The first request left no state in the tree, so its own continuation is replayed.
    assert _details(second)["kind"] == "approximate"
    assert second["meta_info"]["cached_tokens"] >= L - L // 16


def test_without_checkpoints_one_state_slot_per_request_is_enough(servers):
    server = servers["nemotron-h"]
    assert f"max_running_requests={PURE_SLOTS}" in server.log_text()
    assert "capped" not in server.log_text()
    document = random_prompt(L, seed=40)
    ask(server, document + [7], new_tokens=1)
    prompts = [document + random_prompt(8, seed=41 + i) for i in range(PURE_SLOTS)]
    with ThreadPoolExecutor(max_workers=PURE_SLOTS) as pool:
        results = list(pool.map(lambda p: ask(server, p), prompts))
    assert all(r["meta_info"]["completion_tokens"] == 6 for r in results)
    assert {_details(r)["kind"] for r in results} == {"approximate"}


def test_concurrent_clients_with_overlapping_prefixes(servers):
    server, exact = servers["qwen3-next"], OVERRIDES["wL"]   # outputs independent of arrival order
    documents = [random_prompt(L, seed=20), random_prompt(L // 2, seed=21)]
    prompts = [doc + random_prompt(12, seed=30 + i) for i in range(4) for doc in documents]
    sequential = [ask(server, p, exact)["output_ids"] for p in prompts]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        concurrent = list(pool.map(lambda p: ask(server, p, exact)["output_ids"], prompts))
    assert concurrent == sequential
    requests.get(f"{server.url}/health_generate", timeout=60).raise_for_status()
    assert not re.search(r"leak|Traceback", server.log_text(), re.I)


@pytest.mark.parametrize("overrides, needle", [
    ({"budget": 2}, "'budget': must be in [0, 1]"),
    ({"window": 3}, "'window': unknown key"),
    ({"kv_mode": 1}, "'kv_mode': has the wrong type"),
    ({"audit": "yes"}, "'audit': has the wrong type"),
    ({"audit_rate": 0.5}, "'audit_rate': is a server setting"),
    ({"exactness": "maybe"}, "'exactness': must be one of"),
    ({"exact_threshold": 0.5}, "'exact_threshold': is a server setting"),
    ({"repair_kind": "branch"}, "'repair_kind': is set by the server on its own background runs"),
    ({"repair_shared": "yes"}, "'repair_shared': has the wrong type"),
])
def test_bad_request_override_is_that_requests_error(servers, overrides, needle):
    server = servers["qwen3-next"]
    resp = requests.post(f"{server.url}/generate", timeout=60, json={
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "custom_params": {"tail_replay": overrides}}})
    assert resp.status_code == 400 and needle in resp.text
    assert ask(server, [4, 5, 6], new_tokens=1)["meta_info"]["completion_tokens"] == 1   # still serving


@pytest.mark.parametrize("config, needle", [
    ('{"budget": -0.5}', "'budget': must be in [0, 1]"),
    ('{"min_replay_tokens": 64, "max_replay_tokens": 8}', "'max_replay_tokens': must be >= min_replay_tokens"),
    ('{"bugdet": 0.1}', "'bugdet': unknown key"),
    ('{"kv_mode": "fast"}', "'kv_mode': must be one of"),
    ('{"audit_rate": 1.5}', "'audit_rate': must be in [0, 1]"),
    ('{"audit": true}', "'audit': is a per-request key"),
])
def test_bad_config_is_a_clear_start_up_error(tiny_model_factory, config, needle):
    proc = subprocess.run([sys.executable, "-m", "sglang_ext", "serve", "--model-path",
                           str(tiny_model_factory("qwen3-next")), "--radix-cache-backend", "tail_replay",
                           "--tail-replay-config", config], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert needle in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- provenance (exactness)


def _summary(result) -> dict:
    return _details(result)


def test_exact_request_never_reads_an_approximate_requests_kv(servers, hf_qwen):
    """An approximate request inserts the KV it computed past L (bound > 0). A later request with
    `exactness: "exact"` that shares that prompt reuses only the strictly exact part (the shared
    document, not the approximate request's question) and equals transformers' full prefill;
    the approximate request's own summary says it was not exact. (Before provenance the exact
    request reused the approximate KV as if exact.)"""
    server = servers["qwen3-next"]
    document, question = random_prompt(L, seed=80), random_prompt(3 * SUFFIX, seed=81)
    approx = _warm_then_ask(server, document, question, {"keep_checkpoints": False})
    assert _summary(approx)["kind"] == "approximate" and _summary(approx)["exact"] is False
    assert 0 < _summary(approx)["bound"] <= _summary(approx)["state_bound"] <= 1
    follow = document + question + random_prompt(8, seed=82)
    exact = ask(server, follow, {"exactness": "exact", "keep_checkpoints": False})
    summary = _summary(exact)
    assert summary["matched_tokens"] <= L and summary["exact"] is True and summary["bound"] == 0.0
    assert_matches_reference(exact, greedy_reference(hf_qwen, follow, 6))
    # the default mode reuses the approximate KV (it reads KV as it is) and says how far it may be
    default = ask(server, follow, {"keep_checkpoints": False})
    assert _summary(default)["matched_tokens"] > L


def test_a_conversation_pays_its_replay_once(servers):
    """Turn 1 is an approximate hit; its end state is stored with its bound. Turns 2 and 3 resume
    from the previous turn's end state (nothing replayed) and report a bound that decays."""
    server = servers["qwen3-next"]
    document = random_prompt(L, seed=90)
    turn = _warm_then_ask(server, document, random_prompt(SUFFIX, seed=91))
    assert _summary(turn)["kind"] == "approximate"
    history, bounds = document + random_prompt(SUFFIX, seed=91) + turn["output_ids"], [_summary(turn)["bound"]]
    for i in range(2):
        prompt = history + random_prompt(24, seed=92 + i)
        turn = ask(server, prompt)
        summary = _summary(turn)
        assert summary["kind"] in ("approximate_checkpoint", "exact_checkpoint"), summary
        assert summary["replayed_tokens"] <= 1 and summary["reused_tokens"] >= len(history) - 1
        bounds.append(summary["bound"])
        history = prompt + turn["output_ids"]
    print("bounds by turn:", bounds)
    assert bounds[0] > bounds[1] > bounds[2] > 0


def test_exact_first_resumes_from_an_exact_state_the_approximate_mode_would_replay_past(servers, hf_qwen):
    """`exactness: "exact_first"` (the default): an exact state far behind the match (stock
    SGLang's hit) is resumed from and the rest recomputed, so the answer is exact and equals
    transformers' full prefill; `"approximate"` replays the last W tokens of the same match."""
    server = servers["qwen3-next"]
    document = random_prompt(L, seed=120)
    ask(server, document[:128], new_tokens=1)   # its end state, exact, at depth 128
    ask(server, document + random_prompt(5, seed=121), {"keep_checkpoints": False}, new_tokens=1)   # KV to L
    approx = ask(server, document + random_prompt(SUFFIX, seed=122), {"exactness": "approximate"})
    assert _summary(approx)["kind"] == "approximate" and _summary(approx)["exact"] is False
    prompt = document + random_prompt(SUFFIX, seed=123)
    first = ask(server, prompt)   # the server's default
    summary = _summary(first)
    assert summary["kind"] == "exact_checkpoint" and summary["exact"] is True, summary
    assert summary["reused_tokens"] == 128 and summary["replayed_tokens"] == L - 128   # recomputed exactly
    assert first["meta_info"]["cached_tokens"] == 128
    assert_matches_reference(first, greedy_reference(hf_qwen, prompt, 6))


def test_exactness_metrics(servers):
    server = servers["qwen3-next"]
    before = requests.get(f"{server.url}/metrics", timeout=30).text
    _warm_then_ask(server, random_prompt(L, seed=95), random_prompt(SUFFIX, seed=96), {"keep_checkpoints": False})
    after = requests.get(f"{server.url}/metrics", timeout=30).text
    name = "sglang_ext:tail_replay_requests_total"
    assert metric_total(after, name, 'exact="false"') - metric_total(before, name, 'exact="false"') == 1
    assert metric_total(after, name, 'exact="true"') - metric_total(before, name, 'exact="true"') == 1   # warm-up
    stored = "sglang_ext:tail_replay_stored_bound_count"
    assert metric_total(after, stored, 'kind="kv"') > metric_total(before, stored, 'kind="kv"')


def _wait_for(server, name: str, at_least: float, labels: str = "", timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metric_total(_metrics(server), name, labels) < at_least:
        assert time.monotonic() < deadline, f"{name} did not reach {at_least} within {timeout_s} s"
        time.sleep(0.2)


def test_repair_makes_a_conversations_next_turn_exact(servers, hf_qwen):
    """`repair: true`: turn 1 is an approximate hit; once it finishes, the server recomputes its
    sequence exactly in the background (counted in /metrics once inserted, never shown to the
    client), so turn 2 resumes from an exact end state: `exact_checkpoint`, bound 0, outputs equal
    transformers' full prefill. (Without repair it resumes approximately: the test above.)"""
    server = servers["qwen3-next"]
    document, question = random_prompt(L, seed=110), random_prompt(SUFFIX, seed=111)
    repairs, traffic = "sglang_ext:tail_replay_repairs_total", "sglang_ext:tail_replay_requests_total"
    before = _metrics(server)
    turn = _warm_then_ask(server, document, question, {"repair": True})
    assert _summary(turn)["kind"] == "approximate" and _summary(turn)["exact"] is False
    assert set(turn["meta_info"]["cached_tokens_details"]) == {"device", "host", "tail_replay"}
    _wait_for(server, repairs, metric_total(before, repairs, 'kind="answer"') + 1, 'kind="answer"')
    history = document + question + turn["output_ids"]
    prompt = history + random_prompt(24, seed=112)
    follow = ask(server, prompt, {"repair": True})
    summary = _summary(follow)
    assert summary["kind"] == "exact_checkpoint" and summary["exact"] is True and summary["bound"] == 0.0, summary
    assert summary["reused_tokens"] == len(history) - 1 and summary["replayed_tokens"] == 0
    assert_matches_reference(follow, greedy_reference(hf_qwen, prompt, 6))
    after = _metrics(server)
    assert _delta(before, after, repairs, 'kind="answer"') == 1   # turn 2 was exact: no repair
    assert _delta(before, after, traffic) == 3   # warm-up, turns 1-2; not the repair
    _pools_clean(server)


def test_shared_state_repair_makes_the_next_continuation_of_a_shared_prefix_exact(servers, hf_qwen):
    """Shared-state repair (on by default). A document's KV without a state; a first client's
    request replays past it approximately and leaves its end state (approximate) at the end of its
    sequence. Other clients continue that sequence: the first resumes from it (a conversation's
    own state: no repair), the second finds the tree branching below it (still no repair: the
    first continuation stored no state and a leaf is not a branch), the third finds two branches
    and asks for its repair. The server recomputes that prefix exactly in the background, once
    (counted as kind="shared_state", never as traffic), and the next continuation resumes exactly
    from the repaired state and equals transformers' full prefill."""
    server = servers["qwen3-next"]
    shared_repairs = ("sglang_ext:tail_replay_repairs_total", 'kind="shared_state"')
    traffic = "sglang_ext:tail_replay_requests_total"
    document = random_prompt(L, seed=130)
    before = _metrics(server)
    question = random_prompt(SUFFIX, seed=131)
    first = _warm_then_ask(server, document, question)
    assert _summary(first)["kind"] == "approximate" and _summary(first)["exact"] is False
    shared = document + question + first["output_ids"][:-1]   # what the tree holds, its state at the end
    for i in range(3):
        turn = ask(server, shared + random_prompt(8, seed=132 + i), {"keep_checkpoints": False})
        assert _summary(turn)["kind"] == "approximate_checkpoint", _summary(turn)
        assert _summary(turn)["reused_tokens"] == len(shared)
    _wait_for(server, shared_repairs[0], metric_total(before, *shared_repairs) + 1, shared_repairs[1])
    prompt = shared + random_prompt(8, seed=140)
    after_repair = ask(server, prompt)
    summary = _summary(after_repair)
    assert summary["kind"] == "exact_checkpoint" and summary["exact"] is True and summary["bound"] == 0.0, summary
    assert summary["reused_tokens"] == len(shared)
    assert_matches_reference(after_repair, greedy_reference(hf_qwen, prompt, 6))
    after = _metrics(server)
    assert _delta(before, after, *shared_repairs) == 1                       # once
    assert _delta(before, after, "sglang_ext:tail_replay_repairs_total", 'kind="answer"') == 0
    assert _delta(before, after, traffic) == 6           # warm-up, first, three continuations, the last
    _pools_clean(server)


# ---------------------------------------------------------------- live quality audit

AUDIT_KL = "sglang_ext:tail_replay_audit_kl"
AUDIT_LINE = re.compile(r"Tail-Replay audit: rid=(?P<rid>\S+) trigger=(?P<trigger>\w+) kind=(?P<kind>\w+) "
                        r"bound=(?P<bound>\S+) exact=(?P<exact>\w+) kl=(?P<kl>\S+) tv=(?P<tv>\S+) "
                        r"top1_agree=(?P<top1_agree>\w+)")


def _metrics(server) -> str:
    return requests.get(f"{server.url}/metrics", timeout=30).text


def _audit_of(server, result, timeout_s: float = 60.0) -> dict:
    """The served request's audit log line, parsed (waits for its reference run to finish)."""
    rid = result["meta_info"]["id"]
    deadline = time.monotonic() + timeout_s
    while True:
        found = [m.groupdict() for m in AUDIT_LINE.finditer(server.log_text()) if m["rid"] == rid]
        if found:
            assert len(found) == 1, found   # one audit per audited request
            return found[0]
        assert time.monotonic() < deadline, f"no audit of {rid} logged within {timeout_s} s"
        time.sleep(0.5)


def _delta(before: str, after: str, name: str, labels: str = "") -> float:
    return metric_total(after, name, labels) - metric_total(before, name, labels)


def _pools_clean(server) -> None:
    requests.get(f"{server.url}/health_generate", timeout=60).raise_for_status()
    assert not re.search(r"leak|Traceback|audit failed|background run .* failed|repair of .* skipped", server.log_text(), re.I)


def test_forced_audit_of_an_approximate_hit_records_a_divergence(servers):
    """`audit: true` on a known approximate hit: its exact reference run (sent by the server itself)
    differs from it, KL > 0 in /metrics and in the log line, which names its kind and bound; the
    reference run is not counted as traffic and leaves the pools clean."""
    server = servers["qwen3-next"]
    before = _metrics(server)
    result = _warm_then_ask(server, random_prompt(L, seed=100), random_prompt(SUFFIX, seed=101),
                            {"audit": True, "keep_checkpoints": False}, new_tokens=1)
    summary = _summary(result)
    assert summary["kind"] == "approximate" and summary["exact"] is False and summary["audit"] == "forced"
    audit = _audit_of(server, result)
    after = _metrics(server)
    print("audit of an approximate hit:", audit)
    assert audit["trigger"] == "forced" and audit["kind"] == "approximate" and audit["exact"] == "false"
    assert float(audit["bound"]) == pytest.approx(summary["bound"], rel=1e-3)
    assert float(audit["kl"]) > 0 and float(audit["tv"]) > 0
    forced = 'trigger="forced"'
    assert _delta(before, after, f"{AUDIT_KL}_count", forced) == 1
    assert _delta(before, after, f"{AUDIT_KL}_sum", forced) == pytest.approx(float(audit["kl"]), rel=1e-2)
    assert _delta(before, after, "sglang_ext:tail_replay_audits_total",
                  f'top1_agree="{audit["top1_agree"]}"') == 1
    # the warm-up and the question; the reference run is not traffic
    assert _delta(before, after, "sglang_ext:tail_replay_requests_total") == 2
    _pools_clean(server)


def test_forced_audit_of_an_exact_request_records_zero(servers):
    server = servers["qwen3-next"]
    before = _metrics(server)
    result = ask(server, random_prompt(L, seed=102) + random_prompt(SUFFIX, seed=103),
                 {"audit": True, "exactness": "exact"}, new_tokens=1)
    summary = _summary(result)
    assert summary["exact"] is True and summary["bound"] == 0.0 and summary["audit"] == "forced"
    audit = _audit_of(server, result)
    after = _metrics(server)
    assert audit["trigger"] == "forced" and audit["exact"] == "true" and audit["top1_agree"] == "true"
    assert float(audit["kl"]) <= 1e-6
    forced = 'trigger="forced"'
    assert _delta(before, after, f"{AUDIT_KL}_count", forced) == 1
    assert abs(_delta(before, after, f"{AUDIT_KL}_sum", forced)) <= 1e-6
    assert _delta(before, after, "sglang_ext:tail_replay_audits_total", 'top1_agree="true"') == 1
    _pools_clean(server)


def test_audit_rate_samples_approximate_answers_only(servers):
    """The paged server runs `audit_rate: 1`: its approximate answer is audited ("sampled"), and
    the exact warm-up before it is not."""
    server = servers["qwen3-next-paged"]
    before = _metrics(server)
    result = _warm_then_ask(server, random_prompt(L, seed=104), random_prompt(SUFFIX, seed=105),
                            {"keep_checkpoints": False}, new_tokens=1)
    summary = _summary(result)
    assert summary["kind"] == "approximate" and summary["exact"] is False and summary["audit"] == "sampled"
    audit = _audit_of(server, result)
    after = _metrics(server)
    assert audit["trigger"] == "sampled" and float(audit["kl"]) > 0
    assert _delta(before, after, f"{AUDIT_KL}_count", 'trigger="sampled"') >= 1
    assert _delta(before, after, f"{AUDIT_KL}_count", 'trigger="forced"') == 0
    exact = ask(server, random_prompt(L, seed=106), new_tokens=1)   # a miss: exact, never sampled
    assert _summary(exact)["exact"] is True and "audit" not in _summary(exact)
    _pools_clean(server)



def test_kv_exact_says_whether_everything_the_answer_read_was_exact(servers):
    """`exact` (the state counts as exact) and `kv_exact` (no KV or state of bound
    > 0 anywhere on what the answer read) in meta_info and /metrics. A full exact replay over an
    approximate request's KV starts from an exact state (exact under exact_first) but reads that
    KV (not kv_exact); `exactness: "exact"` reads none of it (both)."""
    server = servers["qwen3-next"]
    document, question = random_prompt(L, seed=150), random_prompt(SUFFIX, seed=151)
    before = _metrics(server)
    approx = _details(_warm_then_ask(server, document, question, {"exactness": "approximate",
                                                                  "keep_checkpoints": False}))
    assert approx["kind"] == "approximate" and approx["exact"] is False and approx["kv_exact"] is False
    tainted = _details(ask(server, document + question + random_prompt(4, seed=152),
                           {"budget": 1.0, "keep_checkpoints": False}))
    assert tainted["kind"] == "exact_replay" and tainted["matched_tokens"] == L + SUFFIX, tainted
    assert tainted["exact"] is True and tainted["kv_exact"] is False and 0.0 < tainted["bound"] <= 1e-30
    strict = _details(ask(server, document + question + random_prompt(4, seed=153), {"exactness": "exact"}))
    assert strict["exact"] is True and strict["kv_exact"] is True and strict["matched_tokens"] <= L, strict
    after = _metrics(server)
    name = "sglang_ext:tail_replay_kv_exact_requests_total"
    delta = {v: metric_total(after, name, f'kv_exact="{v}"') - metric_total(before, name, f'kv_exact="{v}"')
             for v in ("true", "false")}
    assert delta == {"true": 2, "false": 2}   # the warm-up and the strict one; the approximate and the replay

# ---------------------------------------------------------------- streaming sessions


def _open_session(server) -> dict:
    opened = requests.post(f"{server.url}/open_session", timeout=60,
                           json={"capacity_of_str_len": 8192, "streaming": True})
    assert opened.status_code == 200, opened.text
    return {"id": opened.json()}


def _turn(server, ids, session, overrides=None):
    custom = {"tail_replay": overrides} if overrides else None
    return requests.post(f"{server.url}/generate", timeout=300, json={
        "input_ids": ids, "session_params": session,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "custom_params": custom}})


def test_a_streaming_session_turn_is_planned_and_honours_its_exactness(servers):
    """SGLang answers a streaming session's later turns from the session's slot, before the tree
    match: each such turn is planned from the provenance its session carried forward (meta_info
    says what it read), and `exactness: "exact"` on a session whose earlier turn was approximate
    is refused with a 400 that says why (the session goes on); an exact session honours it."""
    from sglang_ext.tail_replay import TailReplayConfig

    server = servers["qwen3-next"]
    document = random_prompt(L, seed=140)
    ask(server, document + random_prompt(5, seed=141), {"keep_checkpoints": False}, new_tokens=1)
    session = _open_session(server)
    try:
        first = _turn(server, document + random_prompt(SUFFIX, seed=142), session, {"exactness": "approximate"})
        assert first.status_code == 200, first.text
        assert _details(first.json())["kind"] == "approximate" and _details(first.json())["exact"] is False
        refused = _turn(server, random_prompt(8, seed=143), session, {"exactness": "exact"})
        assert refused.status_code == 400, refused.text
        assert "'exactness': 'exact' cannot be honoured in streaming session" in refused.text
        follow = _turn(server, random_prompt(8, seed=144), session)
        assert follow.status_code == 200, follow.text
        summary = _details(follow.json())
        context = follow.json()["meta_info"]["prompt_tokens"]
        assert summary["kind"] in ("approximate_checkpoint", "exact_checkpoint"), summary
        assert summary["reused_tokens"] == summary["matched_tokens"] == follow.json()["meta_info"]["cached_tokens"]
        assert context - 9 <= summary["reused_tokens"] <= context - 8 and summary["bound"] > 0.0   # the session
        assert summary["exact"] is (summary["bound"] <= TailReplayConfig().server.exact_threshold)
        assert summary["kv_exact"] is False   # turn 1's approximate KV and state are read
    finally:
        requests.post(f"{server.url}/close_session", timeout=60, json={"session_id": session["id"]})
    session = _open_session(server)
    try:
        assert _turn(server, random_prompt(40, seed=145), session).status_code == 200
        turn = _turn(server, random_prompt(8, seed=146), session, {"exactness": "exact"})
        assert turn.status_code == 200, turn.text
        summary = _details(turn.json())
        assert summary["kind"] == "exact_checkpoint" and summary["exact"] is summary["kv_exact"] is True, summary
        assert summary["bound"] == 0.0
        assert summary["reused_tokens"] == turn.json()["meta_info"]["cached_tokens"] >= 40
    finally:
        requests.post(f"{server.url}/close_session", timeout=60, json={"session_id": session["id"]})
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200


def _tenant_turn(server, ids, session, **namespace):
    return requests.post(f"{server.url}/generate", timeout=300, json={
        "input_ids": ids, "session_params": session, **namespace,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0}})


def test_a_session_belongs_to_the_namespace_of_its_first_turn(servers):
    """A session id is chosen by the client: a turn sent under another `extra_key` or
    `cache_salt` than its session's first turn gets a 400 naming the field and reads nothing of
    the session, the other tenant's plain request of the document reuses nothing, and the
    session goes on for its own tenant. The same for a non-streaming session's appended turn."""
    server = servers["qwen3-next"]
    document = random_prompt(400, seed=160)
    session = _open_session(server)
    try:
        first = _tenant_turn(server, document, session, extra_key="tenant-A")
        assert first.status_code == 200, first.text
        for namespace, field in (({"extra_key": "tenant-B"}, "extra_key"),
                                 ({"extra_key": "tenant-A", "cache_salt": "s"}, "cache_salt"),
                                 ({}, "extra_key")):
            foreign = _tenant_turn(server, random_prompt(8, seed=161), session, **namespace)
            assert foreign.status_code == 400, foreign.text
            assert f"this turn's {field} differ" in foreign.text and "tenant-A" not in foreign.text
        plain = server.generate(input_ids=document + random_prompt(8, seed=162), extra_key="tenant-B",
                                sampling_params={"max_new_tokens": 2, "temperature": 0})
        assert plain["meta_info"]["cached_tokens"] == 0, plain["meta_info"]
        own = _tenant_turn(server, random_prompt(8, seed=163), session, extra_key="tenant-A")
        assert own.status_code == 200, own.text
        assert own.json()["meta_info"]["cached_tokens"] >= len(document)   # the session's own context
    finally:
        requests.post(f"{server.url}/close_session", timeout=60, json={"session_id": session["id"]})
    opened = requests.post(f"{server.url}/open_session", timeout=60, json={"capacity_of_str_len": 8192})
    assert opened.status_code == 200, opened.text
    sid = opened.json()
    try:
        first = _tenant_turn(server, document, {"id": sid}, extra_key="tenant-A", rid="tenancy-first")
        assert first.status_code == 200, first.text
        appended = _tenant_turn(server, random_prompt(8, seed=164), {"id": sid, "rid": "tenancy-first"},
                                extra_key="tenant-B")
        assert appended.status_code == 400 and "this turn's extra_key differ" in appended.text, appended.text
    finally:
        requests.post(f"{server.url}/close_session", timeout=60, json={"session_id": sid})
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200


def test_every_server_runs_on_one_byte_budget_by_default(servers):
    """No server here passes `--enable-unified-memory`: Tail-Replay turns it on (its default,
    `startup.unified_memory_default`) and the CPU server runs it (`patches/cpu/unified_memory.py`):
    SGLang took it (the KV pool is page-major, ids are translated), so the tests above that read
    cached K/V (`kv_mode: "exact"` tails, reference comparisons) read it through the translation,
    and the paged server allocates through SGLang's paged allocator's torch twins."""
    for name, server in servers.items():
        info = requests.get(f"{server.url}/get_server_info", timeout=30).json()
        assert info["enable_unified_memory"] is True and info["enable_page_major_kv_layout"] is True, name
