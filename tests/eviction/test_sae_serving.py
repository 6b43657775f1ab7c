"""The server side of SAECache without a server: request fields, the policy config, chat
spans (fixture tokenizer's chat template) and the event adapter (`ServerSAE`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_ext.eviction.sae import SAEConfigError
from sglang_ext.eviction.serving import (
    PathNode,
    RequestFieldError,
    SAERequest,
    ServerSAE,
    TypedSpan,
    chat_spans,
    content_keys,
    parse_request,
    parse_server_config,
)


# ----- request fields ---------------------------------------------------------------
def test_parse_request_maps_aliases_and_session():
    rec = parse_request({"token_types": [[0, 4, "system"], [4, 9, "user"], [9, 12, "assistant"],
                                         [12, 14, "tool"], [14, 16, "reasoning"]], "session": 7}, 16)
    assert [s.token_type for s in rec.spans] == ["system", "user", "response", "tool_output", "reasoning"]
    assert rec.session == "7"
    assert rec.type_at(3, 16) == "system" and rec.type_at(4, 16) == "user"
    assert rec.type_at(16, 16) == "response"  # past the prompt: cached output
    assert parse_request(None, 10) is None
    assert parse_request({}, 10, session_id="abc") == SAERequest(session="abc")
    assert SAERequest(spans=(TypedSpan(2, 4, "user"),)).type_at(0, 10) == "unknown"


@pytest.mark.parametrize("custom, where", [
    ({"token_types": "user"}, "token_types must be a list"),
    ({"token_types": [[0, 4]]}, "token_types[0] must be [start, end, type]"),
    ({"token_types": [[0, 4, "boss"]]}, "token_types[0]: unknown token type 'boss'"),
    ({"token_types": [[3, 3, "user"]]}, "token_types[0]: needs 0 <= start < end"),
    ({"token_types": [[0, 4, "user"], [2, 6, "user"]]}, "token_types[1]: spans must be sorted"),
    ({"token_types": [[0, 40, "user"]]}, "token_types[0]: end 40 is past the prompt (10 tokens)"),
    ({"token_types": [[0.5, 4, "user"]]}, "token_types[0]: start and end must be integers"),
    ({"session": [1]}, "custom_params.session must be a string or an integer"),
])
def test_malformed_fields_name_the_field(custom, where):
    with pytest.raises(RequestFieldError) as err:
        parse_request(custom, 10)
    assert where in str(err.value)
    assert "sampling_params.custom_params" in str(err.value)


# ----- config -----------------------------------------------------------------------
@pytest.mark.parametrize("raw, key", [({"nope": 1}, "'nope'"), ({"cost_power": -1}, "'cost_power'"),
                                      ({"learning": 1}, "'learning'"), ({"block_tokens": 0}, "'block_tokens'"),
                                      ({"clock": "tsc"}, "'clock'"), ({"prior_reuse_s": "30"}, "'prior_reuse_s'"),
                                      ({"state_order": "lfu"}, "'state_order'"),
                                      ({"state_order": True}, "'state_order'")])
def test_bad_config_names_the_key(raw, key):
    with pytest.raises(SAEConfigError) as err:
        parse_server_config(raw)
    assert key in str(err.value)


def test_config_keys_reach_the_policy():
    cfg = parse_server_config({"cost_power": 0, "prior_reuse_s": 5, "block_tokens": 4, "clock": "requests"})
    assert cfg.sae.cost_power == 0 and cfg.sae.prior_reuse_s == 5.0 and cfg.block_tokens == 4
    assert ServerSAE(cfg).policy.config.prior_reuse_s == 5.0


def test_state_order_defaults_per_backend_and_the_key_overrides_both():
    default = parse_server_config({})
    assert default.state_order is None
    assert (default.state_order_for("default"), default.state_order_for("tail_replay")) == ("lru", "sae")
    for value in ("sae", "lru"):
        cfg = parse_server_config({"state_order": value})
        assert cfg.state_order_for("default") == cfg.state_order_for("tail_replay") == value


# ----- chat spans -------------------------------------------------------------------
def test_chat_spans_follow_the_fixture_template(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from eval.fixtures.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, train_tokenizer
    from sglang_ext.patches.sae.chat import request_spans

    tok = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(), additional_special_tokens=SPECIAL_TOKENS)
    tok.chat_template = CHAT_TEMPLATE
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Read the context and answer."},
                {"role": "assistant", "content": "Paris.", "reasoning_content": "The capital is asked."},
                {"role": "tool", "content": "result 42"},
                {"role": "user", "content": "And then?"}]
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    request = SimpleNamespace(messages=messages, chat_template_kwargs=None, tools=None)
    spans = request_spans(tok, request, ids)
    # independent expectation: message k starts at its <|im_start|>
    im_start, think, end_think = tok.convert_tokens_to_ids(["<|im_start|>", "<think>", "</think>"])
    starts = [i for i, t in enumerate(ids) if t == im_start]
    assert len(starts) == 6  # five messages + the generation prompt
    t0, t1 = ids.index(think), ids.index(end_think) + 1
    expected = [(starts[0], starts[1], "system"), (starts[1], starts[2], "user"),
                (starts[2], t0, "response"), (t0, t1, "reasoning"), (t1, starts[3], "response"),
                (starts[3], starts[4], "tool_output"), (starts[4], starts[5], "user"),
                (starts[5], len(ids), "response")]
    assert [(s.start, s.end, s.token_type) for s in spans] == expected
    parse_request({"token_types": [[s.start, s.end, s.token_type] for s in spans]}, len(ids))  # valid field


def test_chat_spans_clamp_templates_that_rewrite_history():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    renders = {1: [1, 2, 3], 2: [1, 2, 3, 9, 9], 3: [1, 2, 3, 4, 5, 6]}  # 2nd render disagrees at 3
    spans = chat_spans(prompt, ["system", "user", "assistant"], renders.__getitem__)
    assert [(s.start, s.end, s.token_type) for s in spans] == [(0, 3, "system"), (3, 6, "response"),
                                                                 (6, 8, "response")]


# ----- the event adapter ------------------------------------------------------------
class FakeTree:
    """Per session a chain of nodes (one per turn); a node is a leaf while the last of its chain."""

    def __init__(self):
        self.next_id = 0
        self.chains: dict[str, list[PathNode]] = {}

    def extend(self, session: str, tokens: list[int]) -> list[PathNode]:
        chain = self.chains.setdefault(session, [])
        start = chain[-1].start + chain[-1].n_tokens if chain else 0
        ends = [n.start + n.n_tokens for n in chain] + [len(tokens)]
        key = content_keys(tokens, ends)[-1]
        self.next_id += 1
        chain.append(PathNode(handle=(session, self.next_id), node_id=self.next_id, key=key, start=start,
                              n_tokens=len(tokens) - start))
        return chain


def drive(server: ServerSAE, rounds: int = 5, sessions: int = 4, turn: int = 32, capacity: int = 3):
    """Round-robin sessions; keep at most ``capacity`` chains' tails cached (evict by the policy's
    victims). Returns (victim session sequence, evicted tails that returned)."""
    tree, tokens, victims = FakeTree(), {f"s{k}": [] for k in range(sessions)}, []
    cached: dict[int, PathNode] = {}
    for r in range(rounds):
        for k in range(sessions):
            s = f"s{k}"
            tokens[s] += [r * 1000 + k * 100 + i for i in range(turn)]
            req = server.request((r, k), SAERequest(session=s), len(tokens[s]))
            chain = tree.extend(s, tokens[s])
            node = chain[-1]
            server.referenced([node], ["user"], req, hit=False)
            cached[node.node_id] = node
            while len(cached) > capacity:
                server.sync(set(cached) - {node.node_id}, lambda h: h[1] in cached)
                victim = server.victim()
                victims.append(victim.handle[0])
                del cached[victim.node_id]
                server.evicted(victim.node_id)
            server.set_evictable(node.node_id, True)
    return victims


def test_decisions_are_deterministic_for_the_same_sequence():
    cfg = parse_server_config({"clock": "requests"})
    a, b = drive(ServerSAE(cfg)), drive(ServerSAE(cfg))
    assert a == b and len(a) > 5


def test_evictions_are_counted_by_type_and_queue_and_time_is_measured():
    server = ServerSAE(parse_server_config({"clock": "requests"}))
    victims = drive(server)
    assert sum(server.stats.evicted_tokens.values()) == 32 * len(victims)
    assert set(server.stats.evicted_tokens) == {("user", "session")}
    assert server.stats.decisions == len(victims) and server.stats.decision_ns > 0
    learned = server.learned()
    assert "model_win_rate" in learned and any(k.startswith("median_reuse_s[session/") for k in learned)


def test_a_returning_evicted_entry_is_a_rereference():
    server = ServerSAE(parse_server_config({"clock": "requests"}))
    node = PathNode("h", 1, content_keys([1, 2, 3], [3])[0], 0, 3)
    server.referenced([node], ["user"], server.request("a", None, 3), hit=False)
    server.set_evictable(1, True)
    assert server.victim().node_id == 1
    server.evicted(1)
    again = PathNode("h2", 2, node.key, 0, 3)  # same tokens, a new tree node
    server.referenced([again], ["user"], server.request("b", None, 3), hit=False)
    assert server.stats.rereferenced_tokens == 3


def test_replay_typed_spans_are_valid_request_fields():
    import numpy as np

    from eval.replay.client import request_custom_params
    from eval.replay.tokens import ScaledRequest, typed_spans
    from sglang_ext.eviction import TOKEN_TYPES

    idx = {name: i for i, name in enumerate(TOKEN_TYPES)}
    blocks = np.asarray([idx["system"]] * 2 + [idx["user"]] + [idx["unknown"]] + [idx["tool_call"]] * 2)
    spans = typed_spans(blocks, 4)
    assert spans == ((0, 8, "system"), (8, 12, "user"), (16, 24, "tool_call"))
    req = ScaledRequest(index=0, time=0.0, session=3, blocks=6, tokens=tuple(range(24)), spans=spans)
    custom = request_custom_params(req)
    record = parse_request(custom, 24)
    assert record.session == "3" and record.type_at(17, 24) == "tool_call" and record.type_at(13, 24) == "unknown"


def test_a_request_matched_twice_touches_once():
    server = ServerSAE(parse_server_config({"clock": "requests"}))
    node = PathNode("h", 1, content_keys([1, 2, 3], [3])[0], 0, 3)
    server.referenced([node], ["user"], server.request("a", None, 3), hit=False)
    server.set_evictable(1, True)
    calls = []
    server.policy.touch = lambda *a, **k: calls.append(a[0])
    req = server.request("b", None, 4)
    server.referenced([node], ["user"], req, hit=True)
    server.referenced([node], ["user"], req, hit=True)
    server.referenced([node], ["user"], server.request("c", None, 4), hit=True)
    assert calls == [node.key, node.key]
