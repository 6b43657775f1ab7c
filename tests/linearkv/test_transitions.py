"""LinearKV's chunk transitions (`compose`): kept under a fixed-size digest of the chunk's key, not
its token ids, and dropped with the tree node that holds the chunk's end state."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_ext.linearkv.transitions import NODE_ATTR, ChunkTransitions, transition_key


def test_the_key_is_a_fixed_size_digest_of_namespace_salt_and_ids():
    long_chunk = list(range(100_000))
    key = transition_key("linearkv-chunk:m|", None, long_chunk)
    assert isinstance(key, bytes) and len(key) == 16   # not the 100,000 ids
    assert key == transition_key("linearkv-chunk:m|", None, tuple(long_chunk))
    variants = {
        key,
        transition_key("linearkv-chunk:m|a", None, long_chunk),      # another tenant
        transition_key("linearkv-chunk:m|", "salt", long_chunk),     # another cache salt
        transition_key("linearkv-chunk:m|", "", long_chunk),         # an empty salt is not None
        transition_key("linearkv-chunk:m|", None, long_chunk[:-1]),  # another chunk
        transition_key("linearkv-chunk:m", "|", long_chunk),         # no ambiguity across fields
    }
    assert len(variants) == 6


def test_a_transition_goes_with_its_nodes_state():
    store = ChunkTransitions()
    decays = {3: torch.rand(4)}
    a, b = transition_key("ns", None, [1, 2, 3]), transition_key("ns", None, [4, 5])
    store.keep(a, decays)
    store.keep(b, {3: torch.rand(4)})
    node = SimpleNamespace()
    store.tie(a, node)
    assert getattr(node, NODE_ATTR) == a and store.get(a) is decays
    store.tie(b, None)            # the insert stored no state: nothing to compose with
    assert b not in store and len(store) == 1
    store.drop_with(node)         # the node's state is freed
    assert a not in store and len(store) == 0 and not hasattr(node, NODE_ATTR)
    store.drop_with(SimpleNamespace())   # a node without a transition: nothing happens
    store.tie(a, node)            # no longer kept: nothing to tie
    assert not hasattr(node, NODE_ATTR)


def test_the_store_stays_bounded():
    store = ChunkTransitions(limit=3)
    keys = [transition_key("ns", None, [i]) for i in range(5)]
    for key in keys:
        store.keep(key, {})
    assert len(store) == 3 and [k in store for k in keys] == [False, False, True, True, True]


def test_the_relocator_copies_at_the_pools_physical_slots_where_ids_are_translated():
    """`--enable-unified-memory`: the tree's and the allocator's slot ids are virtual; the chunk
    copy reads and writes the pool at the translated slots (`translate_kv_loc`)."""
    from sglang_ext.linearkv.model_layers import KeyRelocator

    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(32, 2, 4, generator=gen), torch.randn(32, 2, 4, generator=gen)
    pool = SimpleNamespace(get_key_buffer=lambda layer: k, get_value_buffer=lambda layer: v)
    k0, v0 = k.clone(), v.clone()

    def translate(ids: torch.Tensor) -> torch.Tensor:   # virtual page p -> physical page 3 - p (pages of 8)
        return (3 - ids // 8) * 8 + ids % 8

    src, dst = torch.tensor([1, 2, 3]), torch.tensor([9, 10, 11])
    KeyRelocator(pool, [(0, None)], translate=translate).copy(src, dst, delta=0)
    assert torch.equal(k[translate(dst)], k0[translate(src)]) and torch.equal(v[translate(dst)], v0[translate(src)])
    untouched = [i for i in range(32) if i not in translate(dst).tolist()]
    assert torch.equal(k[untouched], k0[untouched])   # the virtual ids' rows (9-11) were not written
