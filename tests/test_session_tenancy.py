"""Sessions belong to a tenant (`sglang_ext.session_tenancy`, pure): a session is bound to its
first turn's namespace, and a turn from another is refused naming each field that differs."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_ext.session_tenancy import Tenant, bind, refusal


def test_a_session_is_bound_to_its_first_turn_and_refuses_other_namespaces():
    session = SimpleNamespace()
    a = Tenant.of(SimpleNamespace(extra_key="A", cache_salt=None, lora_id=None))
    assert bind(session, a) == a
    assert refusal("s1", bind(session, a), a) is None
    b = Tenant("B", None, None)
    assert bind(session, b) == a   # bound once: a later turn does not rebind it
    why = refusal("s1", a, b)
    assert why is not None and "session_params.id 's1'" in why and "extra_key differ" in why
    assert "'A'" not in why and "'B'" not in why   # the other tenant's key is not echoed
    assert "cache_salt differ" in refusal("s1", a, Tenant("A", "salt", None))
    assert "extra_key and cache_salt and lora_path differ" in refusal("s1", a, Tenant(None, "x", "lora-1"))
    plain = Tenant.of(SimpleNamespace())   # a request without those fields: the default namespace
    assert plain == Tenant(None, None, None) and refusal("s2", plain, plain) is None
