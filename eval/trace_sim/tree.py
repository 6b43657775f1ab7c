"""Static radix view of a trace: blocks grouped into nodes, requests as node paths.

A node is a maximal chain of blocks with one child each, no request ending inside it
and one token type. All blocks of a node are read by exactly the same requests, so the
cache can treat a node as one policy entry whose tail is trimmed block by block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang_ext.eviction import TOKEN_TYPES

from .trace import NO_BLOCK, Trace


@dataclass(frozen=True)
class NodeTree:
    parent: np.ndarray  # int64[n_nodes], NO_BLOCK for roots
    length: np.ndarray  # int64[n_nodes], blocks
    start_block: np.ndarray  # int64[n_nodes], blocks before the node (its depth)
    token_type: tuple[str, ...]
    node_of_block: np.ndarray


@dataclass(frozen=True)
class RequestPaths:
    """Per request: nodes root->prompt end (``n_prompt_nodes`` of them), then the nodes
    that only the cached output adds. Flat int64 array + offsets."""

    nodes: np.ndarray
    offsets: np.ndarray
    n_prompt_nodes: np.ndarray

    def of(self, index: int) -> np.ndarray:
        return self.nodes[self.offsets[index]: self.offsets[index + 1]]


def endpoints(trace: Trace) -> np.ndarray:
    ends = [r.last_block for r in trace.requests] + [r.output_last_block for r in trace.requests]
    ends = np.asarray([e for e in ends if e != NO_BLOCK], dtype=np.int64)
    mask = np.zeros(trace.n_blocks, dtype=bool)
    mask[ends] = True
    return mask


def build_node_tree(trace: Trace) -> NodeTree:
    parent, n = trace.parent, trace.n_blocks
    has_parent = parent != NO_BLOCK
    children = np.bincount(parent[has_parent], minlength=n)
    safe_parent = np.where(has_parent, parent, 0)
    starts = ~has_parent | (children[safe_parent] != 1) | endpoints(trace)[safe_parent] \
        | (trace.block_type != trace.block_type[safe_parent])
    ids = np.arange(n)
    if not np.all(parent[~starts] == ids[~starts] - 1):
        raise ValueError("block ids must be assigned along paths (parent == id - 1 inside a chain)")
    node_of_block = np.cumsum(starts) - 1
    head = ids[starts]
    node_parent = np.where(has_parent[head], node_of_block[safe_parent[head]], NO_BLOCK)
    return NodeTree(parent=node_parent, length=np.bincount(node_of_block),
                    start_block=_depths(parent)[head],
                    token_type=tuple(TOKEN_TYPES[t] for t in trace.block_type[head]),
                    node_of_block=node_of_block)


def _depths(parent: np.ndarray) -> np.ndarray:
    depth = np.zeros(parent.shape[0], dtype=np.int64)
    for block, up in enumerate(parent.tolist()):  # parent < block: one forward pass
        if up != NO_BLOCK:
            depth[block] = depth[up] + 1
    return depth


def build_request_paths(trace: Trace, tree: NodeTree) -> RequestPaths:
    parent = tree.parent.tolist()
    node_of = tree.node_of_block
    flat, offsets, n_prompt = [], [0], []
    for req in trace.requests:
        prompt = _root_path(parent, int(node_of[req.last_block])) if req.last_block != NO_BLOCK else []
        extra = []
        if req.output_last_block != NO_BLOCK:
            extra = _path_until(parent, int(node_of[req.output_last_block]), prompt[-1] if prompt else None)
        flat.extend(prompt)
        flat.extend(extra)
        n_prompt.append(len(prompt))
        offsets.append(len(flat))
    return RequestPaths(np.asarray(flat, dtype=np.int64), np.asarray(offsets, dtype=np.int64),
                        np.asarray(n_prompt, dtype=np.int64))


def _root_path(parent: list[int], node: int) -> list[int]:
    path = []
    while node != NO_BLOCK:
        path.append(node)
        node = parent[node]
    path.reverse()
    return path


def _path_until(parent: list[int], node: int, stop) -> list[int]:
    path = []
    while node != NO_BLOCK and node != stop:
        path.append(node)
        node = parent[node]
    path.reverse()
    return path


def next_uses(paths: RequestPaths, n_nodes: int) -> np.ndarray:
    """For every (request, path position): index of the next request whose prompt path
    contains that node, or len(requests) if none (Belady's oracle)."""
    n_requests = paths.offsets.shape[0] - 1
    out = np.empty(paths.nodes.shape[0], dtype=np.int64)
    last_seen = np.full(n_nodes, n_requests, dtype=np.int64)
    for i in range(n_requests - 1, -1, -1):
        lo, hi = int(paths.offsets[i]), int(paths.offsets[i + 1])
        nodes = paths.nodes[lo:hi]
        out[lo:hi] = last_seen[nodes]
        last_seen[nodes[: int(paths.n_prompt_nodes[i])]] = i
    return out
