"""SAE's state-checkpoint rule in the real patched server (default backend, tiny Qwen3-Next): a
small state pool (`--max-mamba-cache-size`), a KV pool large enough for everything, so only
states are short. A session's turns come every sixth request, five one-off requests between
them. LRU has always freed the session's end state by its next turn (the oldest), so no turn
reuses anything (the default backend needs a state at the end of a hit); once SAE has seen the
session return, it frees the one-offs' states first and the third turn resumes on turn 2's
end state.

LRU and SAE boot side by side, then serve the same request sequence one after the other.
"""

from __future__ import annotations

import json
import random

from eval.harness import ServerProcess, servers_running

STATE_SLOTS, GAP, NEW = 4, 5, 4


def _args(policy: str) -> list[str]:
    config = {"clock": "requests", "state_order": "sae"}   # the rule is off by default on this backend
    extra = ["--radix-eviction-policy-config", json.dumps(config)] if policy == "sae" else []
    return ["--dtype", "float32", "--radix-eviction-policy", policy, *extra, "--max-total-tokens", "4000",
            "--max-mamba-cache-size", str(STATE_SLOTS), "--max-running-requests", "1",
            "--chunked-prefill-size", "256"]


def run_workload(server: ServerProcess) -> list[int]:
    """Cached tokens per request: the session's turns 1, 2, 3 with GAP one-off requests after each
    (a turn: the conversation so far + new user tokens), so the session returns every GAP + 1
    requests: SAE learns that gap from its first return."""
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

    for r, n_user in enumerate((60, 20, 20)):
        turn(n_user)
        if r < 2:
            for i in range(GAP):
                one_off(GAP * r + i)
    return cached


def test_sae_keeps_the_checkpoint_of_the_session_that_returns(tiny_model_factory, tmp_path):
    model = str(tiny_model_factory("qwen3-next"))
    servers = {policy: ServerProcess(model, _args(policy), log_path=tmp_path / f"{policy}.log") for policy in ("lru", "sae")}
    with servers_running(list(servers.values())):   # booted side by side, served one after the other
        results = {policy: run_workload(server) for policy, server in servers.items()}
    print(f"\ncached tokens per request\n  lru: {results['lru']}\n  sae: {results['sae']}")
    lru, sae = results["lru"], results["sae"]
    turn_3 = 2 * GAP + 2   # index of the third turn
    assert lru[:turn_3] == sae[:turn_3] == [0] * turn_3   # nothing learned yet: both lose turn 1's state
    assert lru[turn_3] == 0                               # LRU freed the session's states again
    assert sae[turn_3] >= 60 + 20 + NEW                   # SAE kept the end state of turn 2
