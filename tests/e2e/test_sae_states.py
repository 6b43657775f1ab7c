"""SAE's state-checkpoint rule in the real patched server (default backend, tiny Qwen3-Next): a
small state pool (`--max-mamba-cache-size`), a KV pool large enough for everything, so only
states are short. A session comes back once, then one-off requests fill the state pool, then the
session's third turn. LRU has freed the session's end states by then (the oldest), so the third
turn reuses nothing (the default backend needs a state at the end of a hit); SAE frees the
one-offs' states first and the session resumes on its checkpoint.

Servers run one at a time: LRU, then SAE, each serving the same request sequence.
"""

from __future__ import annotations

import json
import random

from eval.harness import ServerProcess

STATE_SLOTS, ONE_OFFS, NEW = 4, 6, 4


def _args(policy: str) -> list[str]:
    extra = ["--radix-eviction-policy-config", json.dumps({"clock": "requests"})] if policy == "sae" else []
    return ["--dtype", "float32", "--radix-eviction-policy", policy, *extra, "--max-total-tokens", "4000",
            "--max-mamba-cache-size", str(STATE_SLOTS), "--max-running-requests", "1",
            "--chunked-prefill-size", "256"]


def run_workload(server: ServerProcess) -> list[int]:
    """Cached tokens per request: session turn 1, a one-off, session turn 2, the one-offs,
    session turn 3 (each turn: the conversation so far + 20 new user tokens)."""
    rnd = random.Random(1)
    conversation: list[int] = []
    cached = []

    def send(ids, session):
        custom = {"session": session} if session else {}
        out = server.generate(input_ids=ids, sampling_params={"max_new_tokens": NEW, "temperature": 0,
                                                              "custom_params": custom})
        cached.append(out["meta_info"]["cached_tokens"])
        return out["output_ids"]

    def turn(n_user):
        conversation.extend(rnd.randrange(10, 500) for _ in range(n_user))
        conversation.extend(send(list(conversation), "conversation-1"))

    def one_off(i):
        send([rnd.randrange(10, 500) for _ in range(30 + i)], None)

    turn(60)
    one_off(0)
    turn(20)
    for i in range(1, ONE_OFFS + 1):
        one_off(i)
    turn(20)
    return cached


def test_sae_keeps_the_checkpoint_of_the_session_that_returns(tiny_model_factory, tmp_path):
    model = str(tiny_model_factory("qwen3-next"))
    results = {}
    for policy in ("lru", "sae"):
        with ServerProcess(model, _args(policy), log_path=tmp_path / f"{policy}.log") as server:
            results[policy] = run_workload(server)
    print(f"\ncached tokens per request\n  lru: {results['lru']}\n  sae: {results['sae']}")
    lru, sae = results["lru"], results["sae"]
    assert lru[:3] == sae[:3] and lru[2] > 60           # turn 2 resumes on turn 1's state in both
    assert lru[-1] == 0                                   # LRU freed the session's states
    assert sae[-1] >= 60                                  # SAE kept a checkpoint of the session
