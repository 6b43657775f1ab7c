"""Tree inspection shared by the cache tests."""

from __future__ import annotations

from sglang_ext.tail_replay import record_of


def tree_nodes(cache) -> list:
    """(node, depth in tokens) for every node of `cache`'s tree but the root."""
    out, stack = [], [(cache.tree_core.root_node, 0)]
    while stack:
        node, depth = stack.pop()
        for child in node.children.values():
            out.append((child, depth + len(child.key)))
            stack.append(out[-1])
    return out


def assert_slots_accounted(cache, pool, alloc, running, kv_total: int, mamba_total: int) -> tuple[list, list]:
    """Every KV and state slot is free, held by the tree or by a running request, exactly once,
    and the tree's evictable + protected sizes add up. Returns (tree KV slots, tree state slots)."""
    free_kv = alloc.get_all_free_pages().tolist()   # page-1 allocator: pages are slots
    tree_kv = cache.all_values_flatten().tolist()
    req_kv: list[int] = []
    for req in running:
        row = pool.req_to_token[req.kv.req_pool_idx]
        req_kv += row[req.kv.cache_protected_len:req.kv.kv_allocated_len].tolist()
        record = record_of(req)
        own = None if record is None else record.own_kv   # kv_mode "recompute": the request's tail KV
        if own is not None:
            req_kv += own[1].tolist()
    held = free_kv + tree_kv + req_kv
    assert len(held) == len(set(held)), "a KV slot is held twice"
    assert sorted(held) == list(range(1, kv_total + 1)), "leaked KV slots"

    tree_state = cache.all_mamba_values_flatten().tolist()
    req_state = [int(r.kv.mamba_pool_idx) for r in running if r.kv.holds_mamba]
    held = pool.mamba_allocator.free_slots.tolist() + tree_state + req_state
    assert len(held) == len(set(held)), "a state slot is held twice"
    assert sorted(held) == list(range(1, mamba_total + 1)), "leaked state slots"

    assert cache.full_evictable_size() + cache.full_protected_size() == len(tree_kv)
    assert cache.mamba_evictable_size() + cache.mamba_protected_size() == len(tree_state)
    return tree_kv, tree_state
