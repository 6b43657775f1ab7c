"""The ideal and LRU-bound references on hand-made token sequences (numbers worked out by hand)."""

from __future__ import annotations

import random

import pytest

from eval.replay.bound import TokenTrieLRU, ideal_curve, lru_curve, reuse_curve

# five requests over tokens; letters for readability
A, B, C, D, E, F, G, X = range(1, 9)
SEQS = [
    [A, B, C, D],        # 0: nothing before                                  -> 0
    [A, B, C, E, F],     # 1: LCP with 0 is ABC                                -> 3
    [A, B, C, D],        # 2: equal to 0, but at most len - 1 = 3 are reusable -> 3
    [X, G],              # 3: new root                                         -> 0
    [A, B, C, E, F, G],  # 4: LCP with 1 is ABCEF                              -> 5
]


def test_ideal_by_hand():
    curve = ideal_curve(SEQS)
    assert curve.per_request == (0, 3, 3, 0, 5)
    assert curve.total == 11 and curve.capacity_tokens is None


def test_lru_by_hand_capacity_6():
    # After 0: ABCD (4 nodes). After 1: + E,F = 6 nodes; stamps ABC=1 E,F=1 D=0.
    # 2: hit 3 (ABCD present, capped at len-1); stamps ABCD=2, E,F=1; size 6.
    # 3: insert X,G -> 8 nodes > 6: evict oldest leaves: F (stamp 1), then E (now a leaf, stamp 1).
    #    Trie: ABCD (2), XG (3).
    # 4: ABCEFG matches only ABC -> 3. Insert E,F,G -> 9 nodes: evict D (stamp 2, leaf), then G
    #    (stamp 3 leaf of X), then X -> 6 nodes: ABCEFG.
    curve = lru_curve(SEQS, 6)
    assert curve.per_request == (0, 3, 3, 0, 3)
    assert curve.total == 9


def test_lru_by_hand_capacity_4_keeps_the_newest_request():
    # 0: ABCD (4). 1: ABCEF -> 6 > 4: evict D (stamp 0), then F (stamp 1; tie with nothing else
    #    older) -> ABCE. 2: ABCD matches ABC -> 3; insert D -> 5: leaves E (1), D (2): evict E -> ABCD.
    # 3: XG -> 6: evict D (2), then C (2, now a leaf), ... leaves ordered by stamp: D=2 first,
    #    then C=2 (became leaf) -> ABXG. 4: ABCEFG matches AB -> 2.
    curve = lru_curve(SEQS, 4)
    assert curve.per_request == (0, 3, 3, 0, 2)


def test_lru_with_room_for_everything_equals_ideal():
    assert lru_curve(SEQS, 10_000).per_request == ideal_curve(SEQS).per_request


@pytest.mark.parametrize("seed", range(5))
def test_lru_never_exceeds_ideal_and_holds_at_most_capacity(seed):
    rng = random.Random(seed)
    seqs = [[rng.randrange(3) for _ in range(rng.randint(1, 12))] for _ in range(60)]
    ideal = ideal_curve(seqs)
    for cap in (1, 5, 20, 80):
        trie = TokenTrieLRU(cap)
        curve = reuse_curve(seqs, cap, "lru")
        for i, s in enumerate(seqs):
            trie.insert(s, i)
            assert trie.size <= cap
        assert all(h <= i for h, i in zip(curve.per_request, ideal.per_request))
    # brute-force ideal: longest common prefix with any earlier request, capped at len - 1
    for i, s in enumerate(seqs):
        best = 0
        for t in seqs[:i]:
            k = 0
            while k < min(len(s), len(t)) and s[k] == t[k]:
                k += 1
            best = max(best, k)
        assert ideal.per_request[i] == min(best, len(s) - 1)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        TokenTrieLRU(0)
