"""SAE's session table in a server: bounded (`max_sessions`), keyed by tenant (SGLang's tree
namespace: `extra_key`, `cache_salt`), fair between tenants, and what the policy forgets when a
session leaves the table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_ext.eviction.sae import SAEConfigError
from sglang_ext.eviction.serving import (
    DEFAULT_MAX_SESSIONS,
    DEFAULT_TENANT,
    PathNode,
    SAERequest,
    ServerConfig,
    ServerSAE,
    SessionTable,
    parse_server_config,
    tenant_of,
)

A, B, C = tenant_of("tenant-a", None), tenant_of("tenant-b", None), tenant_of(None, "salt-c")


def _node(i: int, tokens: int = 16) -> PathNode:
    return PathNode(handle=i, node_id=i, key=i.to_bytes(16, "big"), start=0, n_tokens=tokens)


# ----- the table ------------------------------------------------------------------------
def test_one_tenant_evicts_its_least_recently_used_session_in_exact_order():
    table = SessionTable(3)
    ids = {name: table.use(A, name) for name in "abc"}
    assert ids == {"a": (0, []), "b": (1, []), "c": (2, [])}
    assert table.use(A, "a") == (0, [])            # a is now the most recent: b is the oldest
    assert table.use(A, "d") == (3, [1])           # b goes
    assert table.use(A, "e") == (4, [2])           # then c
    assert table.use(A, "a") == (0, [])
    assert table.use(A, "f") == (5, [3])           # then d (a was used again)
    assert table.sessions_of(A) == ["e", "a", "f"] and len(table) == 3
    assert table.use(A, "b") == (6, [4])           # an evicted session comes back as a new one
    assert not table.holds(1) and table.holds(6)


def test_a_tenant_past_its_share_evicts_its_own_sessions_not_anothers():
    table = SessionTable(4)
    assert [table.use(A, n)[1] for n in ("a1", "a2")] == [[], []]
    assert [table.use(B, n)[1] for n in ("b1", "b2")] == [[], []]
    a1, a2 = table.use(A, "a1")[0], table.use(A, "a2")[0]
    # B floods: each new session of B evicts B's own least recently used, never A's (A holds
    # its fair share, 4 // 2), although A's sessions are older than B's
    evicted = [table.use(B, f"b{k}")[1] for k in range(3, 40)]
    assert evicted[:3] == [[2], [3], [4]] and all(len(e) == 1 for e in evicted)
    assert table.sessions_of(A) == ["a1", "a2"] and table.holds(a1) and table.holds(a2)
    assert table.sessions_of(B) == ["b38", "b39"]


def test_ties_between_the_largest_tenants_go_to_the_one_whose_oldest_session_is_oldest():
    table = SessionTable(4)
    table.use(A, "a1")                       # id 0, the oldest use
    table.use(B, "b1")                       # id 1
    table.use(A, "a2")                       # id 2
    table.use(B, "b2")                       # id 3
    assert table.use(C, "c1") == (4, [0])    # A and B hold 2 each: A's a1 is the oldest
    assert table.use(C, "c2") == (5, [1])    # B (2) over A (1) and C (2, newer): B's b1
    assert table.use(A, "a3") == (6, [2])    # A and C hold 2: A's a2 is older than C's c1
    assert [table.sessions_of(t) for t in (A, B, C)] == [["a3"], ["b2"], ["c1", "c2"]]


def test_the_same_name_in_two_tenants_is_two_sessions():
    table = SessionTable(8)
    a, _ = table.use(A, "conversation-1")
    b, _ = table.use(B, "conversation-1")
    assert a != b and table.use(A, "conversation-1") == (a, [])


def test_the_cap_is_an_integer_of_at_least_one():
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="cap must be an integer >= 1"):
            SessionTable(bad)


# ----- tenants ----------------------------------------------------------------------------
def test_tenants_are_sglangs_namespaces_and_never_collide():
    assert tenant_of("a|", None) != tenant_of("a", "|")        # no separator to forge
    assert tenant_of("", None) != tenant_of(None, None)        # SGLang's tree keeps these apart
    assert tenant_of(None, "") == tenant_of(None, None) == DEFAULT_TENANT   # SGLang: empty salt is None
    assert len({tenant_of(e, s) for e in (None, "", "x") for s in (None, "x", "y")}) == 9


def test_the_adapter_keys_a_requests_session_by_its_extra_key_and_cache_salt():
    from sglang_ext.eviction.sglang_adapter import request_record

    def req(extra_key=None, cache_salt=None, custom=None):
        return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=custom), session_id=None,
                               extra_key=extra_key, cache_salt=cache_salt)

    record = request_record(req("lora-1", "s", {"session": "conv"}))
    assert record == SAERequest(session="conv", tenant=tenant_of("lora-1", "s"))
    assert request_record(req(None, "s")) == SAERequest(tenant=tenant_of(None, "s"))
    assert request_record(req(custom={"session": 3})).tenant == DEFAULT_TENANT


# ----- the server ---------------------------------------------------------------------------
def test_one_tenants_requests_never_move_anothers_session_statistics():
    server = ServerSAE(ServerConfig(clock="requests"))
    owners = server.policy.queues.owners
    ra = server.request("r1", SAERequest(session="s", tenant=A), 16)
    server.referenced([_node(1)], ["user"], ra, hit=False)
    rb = server.request("r2", SAERequest(session="s", tenant=B), 16)
    server.referenced([_node(2)], ["user"], rb, hit=False)
    assert ra.session != rb.session
    assert (owners[("session", ra.session)].request, owners[("session", ra.session)].t_request) == (1, 1.0)
    again = server.request("r3", SAERequest(session="s", tenant=A), 32)
    server.referenced([_node(1), _node(3)], ["user", "user"], again, hit=True)
    assert again.session == ra.session
    assert owners[("session", ra.session)].request == 3 and owners[("session", rb.session)].request == 2
    # a client reusing another tenant's rid gets a request of its own
    assert server.request("r1", SAERequest(session="s", tenant=B), 16).index == 4
    assert server.request("r1", SAERequest(session="s", tenant=A), 16) == ra


def test_sessions_past_the_cap_are_forgotten_by_the_policy():
    server = ServerSAE(ServerConfig(clock="requests", max_sessions=2))
    owners = server.policy.queues.owners
    infos = []
    for k in range(50):   # 50 sessions of one tenant, each caching one node
        info = server.request(f"r{k}", SAERequest(session=f"s{k}", tenant=A), 16)
        server.referenced([_node(k)], ["user"], info, hit=False)
        infos.append(info)
    assert len(server.sessions) == 2 and server.sessions.sessions_of(A) == ["s48", "s49"]
    # an evicted session keeps its owner while it owns an entry, then goes with its last one
    assert ("session", infos[0].session) in owners and owners[("session", infos[0].session)].retired
    for k in range(50):
        server.set_evictable(k, True)
    for k in range(48):
        server.evicted(k)
    assert sorted(key for key in owners if key[0] == "session") == [("session", 48), ("session", 49)]


def test_an_evicted_session_with_nothing_cached_is_forgotten_at_once():
    server = ServerSAE(ServerConfig(clock="requests", max_sessions=1))
    owners = server.policy.queues.owners
    first = server.request("r0", SAERequest(session="s0", tenant=A), 16)
    server.referenced([_node(0)], ["user"], first, hit=False)
    server.set_evictable(0, True)
    server.evicted(0)
    assert ("session", first.session) in owners        # a tracked session waits with no entry
    server.request("r1", SAERequest(session="s1", tenant=B), 16)
    assert ("session", first.session) not in owners


def test_a_request_in_flight_whose_session_was_evicted_counts_as_of_no_session():
    server = ServerSAE(ServerConfig(clock="requests", max_sessions=1))
    first = server.request("r0", SAERequest(session="s0", tenant=A), 16)
    server.request("r1", SAERequest(session="s1", tenant=A), 16)   # evicts s0
    again = server.request("r0", SAERequest(session="s0", tenant=A), 16)   # r0 matched again
    assert (again.index, again.session) == (first.index, None)
    server.referenced([_node(0)], ["user"], again, hit=False)
    assert ("request", first.index) in server.policy.queues.owners
    assert ("session", first.session) not in server.policy.queues.owners


# ----- the knob -----------------------------------------------------------------------------
def test_max_sessions_is_a_validated_config_key_with_a_bounded_default():
    assert parse_server_config({}).max_sessions == DEFAULT_MAX_SESSIONS == 16384
    assert parse_server_config({"max_sessions": 3}).max_sessions == 3
    assert ServerSAE(parse_server_config({"max_sessions": 3})).sessions.cap == 3
    for bad in (0, -5, True, 1.5, "100"):
        with pytest.raises(SAEConfigError, match="key 'max_sessions' must be an integer >= 1"):
            parse_server_config({"max_sessions": bad})
