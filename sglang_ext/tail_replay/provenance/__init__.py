"""Provenance: what every cached token and state of the tree was computed from, and how far it may
be from the exact one. One package, four modules, read in this order:

- `bounds` (pure): the bound types and their math. A node's `NodeProvenance` (per position, the
  bound of its KV; at its end, the bound of its state), a matched path's `PathProvenance`, a
  request's `CarryBound` (what it computes after an approximate start), and `counts_exact`, the one
  test of whether a bound counts as exact.
- `forward` (pure): the bound an approximate replay measures in its own forward, from the gates of
  its replayed tail (`TailDecay`, `BoundSegments`, `summarize` into a `StateBound`).
- `writes` (pure): the one write path. `InsertContext` decides the bounds of everything that enters
  the tree (an insert, a split, an overlap, a session turn, a host-tier load, a chunk assembly);
  where the provenance is unknown it writes UNTRACKED: fail closed.
- `tree` (SGLang adapter): the tree hooks. `ProvenanceWriter` stores what `writes` decided on the
  nodes (insert, split, overlap), and `MatchedPath` walks a match's path once to read it back.

The package imports nothing itself: import the module you need
(`from sglang_ext.tail_replay.provenance.bounds import counts_exact`).
"""
