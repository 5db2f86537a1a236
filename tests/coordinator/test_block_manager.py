"""coordinator/block_manager.py: reference counts, the LRU free list and prefix caching verified by token ids."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.block_manager import BlockManager, block_key

BS = 4


def check_invariants(bm: BlockManager, tables: list[list[int]]) -> None:
    """ref_count == number of owning tables; free list == blocks nobody owns; the cache index is consistent."""
    owners = np.zeros(bm.num_blocks, int)
    for t in tables:
        assert len(set(t)) == len(t), f"a block twice in one table: {t}"
        for b in t:
            owners[b] += 1
    for blk in bm.blocks:
        assert blk.ref_count == owners[blk.block_id], (
            f"block {blk.block_id}: ref {blk.ref_count} vs {owners[blk.block_id]}"
        )
        assert (blk.block_id in bm.free) == (blk.ref_count == 0)
        if owners[blk.block_id] > 1:
            assert blk.key >= 0, f"block {blk.block_id} shared by {owners[blk.block_id]} tables without a cache key"
        if blk.key >= 0:
            assert len(blk.token_ids) == bm.block_size
    assert len(bm.free) == bm.num_free_blocks == int((owners == 0).sum())
    for key, b in bm.cached.items():
        assert bm.blocks[b].key == key


def chain_keys(tokens: list[int], bs: int = BS) -> list[int]:
    keys, key = [], -1
    for i in range(len(tokens) // bs):
        key = block_key(tokens[i * bs : (i + 1) * bs], key)
        keys.append(key)
    return keys


def admit(bm: BlockManager, tokens: list[int]) -> tuple[list[int], int]:
    """Allocate a prompt like the scheduler does; returns (table, cached tokens)."""
    hits = bm.match_prefix(tokens)
    table: list[int] = []
    assert bm.allocate(table, hits, len(tokens))
    return table, len(hits) * bm.block_size


def compute_all(bm: BlockManager, table: list[int], tokens: list[int], keyed: int = 0, key: int = -1):
    return bm.register_full_blocks(table, tokens, len(tokens), keyed, key)


def test_allocate_and_free_everything():
    bm = BlockManager(10, BS)
    tables = [[], [], []]
    assert bm.allocate(tables[0], [], 9)  # 3 blocks
    assert bm.allocate(tables[1], [], 4)  # 1 block
    assert bm.allocate(tables[2], [], 20)  # 5 blocks
    check_invariants(bm, tables)
    assert bm.num_free_blocks == 1
    # too big: refused, nothing changes
    before = list(tables[0])
    assert not bm.allocate(tables[0], [], 9 + 2 * BS)
    assert tables[0] == before and bm.num_free_blocks == 1
    check_invariants(bm, tables)
    # growing in place
    assert bm.allocate(tables[1], [], 5)
    assert len(tables[1]) == 2 and bm.num_free_blocks == 0
    for t in tables:
        bm.free_blocks(t)
        assert t == []
    check_invariants(bm, [])
    assert all(b.ref_count == 0 for b in bm.blocks) and bm.num_free_blocks == 10


def test_double_free_is_caught():
    bm = BlockManager(4, BS)
    t: list[int] = []
    bm.allocate(t, [], 4)
    copy = list(t)
    bm.free_blocks(t)
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free_blocks(copy)


def test_prefix_hit_shares_blocks_with_reference_counts():
    bm = BlockManager(16, BS)
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    a, cached = admit(bm, prompt)
    assert cached == 0
    compute_all(bm, a, prompt)
    b, cached = admit(bm, prompt + [7, 8])
    assert cached == 8 and b[:2] == a[:2] and b[2] != a[2]
    check_invariants(bm, [a, b])
    assert [bm.blocks[x].ref_count for x in a[:2]] == [2, 2]
    bm.free_blocks(a)
    check_invariants(bm, [b])
    bm.free_blocks(b)
    check_invariants(bm, [])
    assert all(blk.ref_count == 0 for blk in bm.blocks) and bm.num_free_blocks == 16


def test_freed_prefix_is_revived_from_the_free_list():
    bm = BlockManager(8, BS)
    prompt = list(range(9))
    a, _ = admit(bm, prompt)
    compute_all(bm, a, prompt)
    first_two = a[:2]
    bm.free_blocks(a)
    assert bm.num_free_blocks == 8
    b, cached = admit(bm, prompt)
    assert cached == 8 and b[:2] == first_two
    check_invariants(bm, [b])


def test_hash_collision_is_not_used():
    """A cache entry whose key matches but whose stored tokens differ must not be used."""
    bm = BlockManager(8, BS)
    other = [9, 9, 9, 9, 5]
    a, _ = admit(bm, other)
    compute_all(bm, a, other)
    victim_block = a[0]
    bm.free_blocks(a)
    prompt = [1, 2, 3, 4, 5]
    forged = chain_keys(prompt)[0]
    bm.cached[forged] = victim_block  # as if [1, 2, 3, 4] hashed to the same key as [9, 9, 9, 9]
    assert bm.match_prefix(prompt) == []
    b, cached = admit(bm, prompt)
    assert cached == 0 and victim_block not in b[:1]
    # the real prefix still hits
    assert bm.match_prefix(other) == [victim_block]


def test_hit_stops_at_first_mismatching_block():
    bm = BlockManager(12, BS)
    prompt = list(range(13))
    a, _ = admit(bm, prompt)
    compute_all(bm, a, prompt)
    changed = prompt[:4] + [99] + prompt[5:]
    assert bm.match_prefix(changed) == a[:1]
    # a later block with equal tokens but another history is not a hit either (the key is chained)
    shifted = [50, 51, 52, 53] + prompt[4:]
    assert bm.match_prefix(shifted) == []


def test_reused_block_drops_its_old_key():
    bm = BlockManager(3, BS)
    p1 = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    a, _ = admit(bm, p1)
    compute_all(bm, a, p1)
    k1 = chain_keys(p1)
    assert set(bm.cached) == set(k1)
    bm.free_blocks(a)
    # a different prompt needs every block: the keyed ones are reused for new content
    p2 = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    b, cached = admit(bm, p2)
    assert cached == 0 and sorted(b) == [0, 1, 2]
    assert not (set(k1) & set(bm.cached))
    assert all(bm.blocks[x].key == -1 and bm.blocks[x].token_ids == () for x in b)
    assert bm.match_prefix(p1) == []
    check_invariants(bm, [b])


def test_lru_evicts_suffixes_before_prefixes_and_old_before_new():
    bm = BlockManager(6, BS)
    p1 = list(range(12))
    a, _ = admit(bm, p1)
    compute_all(bm, a, p1)
    bm.free_blocks(list(a))
    # one new block: taken from the tail of the freed prompt, the prefix survives
    t: list[int] = []
    assert bm.allocate(t, [], 4)
    assert t[0] not in a  # never-used blocks first (they were at the front of the LRU)
    t2: list[int] = []
    assert bm.allocate(t2, [], 12)
    assert a[2] in t2 + t and a[0] not in t2
    assert bm.match_prefix(p1 + [1]) == a[:2]


def test_fully_cached_prompt_leaves_a_token_to_compute():
    bm = BlockManager(8, BS)
    prompt = list(range(8))  # exactly two full blocks
    a, _ = admit(bm, prompt)
    compute_all(bm, a, prompt)
    hits = bm.match_prefix(prompt)
    assert len(hits) * BS < len(prompt)  # never everything
    assert hits == a[:1]
    assert bm.match_prefix(prompt + [8]) == a[:2]  # one more token: both blocks hit, 1 token left
    assert bm.match_prefix(prompt[:1]) == []


def test_same_prefix_computed_twice_keeps_one_key():
    """Two sequences that computed one prefix in the same step: each keeps its own block, one is keyed."""
    bm = BlockManager(8, BS)
    prompt = list(range(6))
    a, _ = admit(bm, prompt)
    b, cached = admit(bm, prompt)  # no hit yet: nothing was registered
    assert cached == 0 and not set(a) & set(b)
    compute_all(bm, a, prompt)
    compute_all(bm, b, prompt)
    assert bm.blocks[a[0]].key >= 0 and bm.blocks[b[0]].key == -1
    assert bm.cached[chain_keys(prompt)[0]] == a[0]
    check_invariants(bm, [a, b])
    bm.free_blocks(a)
    bm.free_blocks(b)
    check_invariants(bm, [])


def test_allocate_with_revived_hits_accounts_for_them():
    """Hits that sit in the free list use up free blocks: the size check must count them."""
    bm = BlockManager(4, BS)
    p = list(range(9))
    a, _ = admit(bm, p)  # 3 blocks
    compute_all(bm, a, p)
    bm.free_blocks(a)
    hits = bm.match_prefix(p)
    assert len(hits) == 2
    t: list[int] = []
    # 2 revived + 3 new = 5 > 4 blocks: refused without side effects
    assert not bm.allocate(t, hits, 20)
    assert t == [] and bm.num_free_blocks == 4
    check_invariants(bm, [])
    assert bm.allocate(t, hits, 16)
    check_invariants(bm, [t])
    assert bm.num_free_blocks == 0


def test_prefix_caching_disabled():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    p = list(range(9))
    a, _ = admit(bm, p)
    compute_all(bm, a, p)
    assert bm.cached == {} and bm.match_prefix(p) == []


def test_random_alloc_free_keeps_invariants():
    rng = np.random.default_rng(0)
    bm = BlockManager(24, BS)
    prefixes = [rng.integers(0, 50, 12).tolist() for _ in range(3)]
    live: list[tuple[list[int], list[int]]] = []
    for _ in range(600):
        if live and (rng.random() < 0.45 or bm.num_free_blocks < 4):
            table, tokens = live.pop(int(rng.integers(0, len(live))))
            compute_all(bm, table, tokens)
            bm.free_blocks(table)
        else:
            tokens = prefixes[int(rng.integers(0, 3))][: int(rng.integers(0, 13))] + rng.integers(0, 50, 5).tolist()
            hits = bm.match_prefix(tokens)
            for i, h in enumerate(hits):  # every hit holds exactly the tokens it stands for
                assert bm.blocks[h].token_ids == tuple(tokens[i * BS : (i + 1) * BS])
            table: list[int] = []
            if bm.allocate(table, hits, len(tokens)):
                live.append((table, tokens))
        check_invariants(bm, [t for t, _ in live])
    for table, _ in live:
        bm.free_blocks(table)
    check_invariants(bm, [])
    assert bm.num_free_blocks == 24
