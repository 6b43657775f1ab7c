"""Tree inspection shared by the cache tests."""

from __future__ import annotations


def tree_nodes(cache) -> list:
    """(node, depth in tokens) for every node of `cache`'s tree but the root."""
    out, stack = [], [(cache.tree_core.root_node, 0)]
    while stack:
        node, depth = stack.pop()
        for child in node.children.values():
            out.append((child, depth + len(child.key)))
            stack.append(out[-1])
    return out
