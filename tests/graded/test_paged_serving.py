"""Graded: paged KV memory (BlockAllocator), paged attention and one step of continuous batching.
References are written here: a dict of reference counts, attention per sequence, per position and per
head over keys gathered slot by slot, and the scheduling rules as a plain loop over lists."""

import math
import random
from functools import partial

import pytest
import torch
from adapters import make_block_allocator, run_continuous_batching_step, run_paged_attention, script
from reference_serving import ref_step

# --- the block allocator ----------------------------------------------------------------------------


def test_allocate_every_block_then_refuse():
    alloc = make_block_allocator(5, 16)
    got = [alloc.allocate() for _ in range(5)]
    assert sorted(got) == list(range(5)) and alloc.num_free == 0
    with pytest.raises(RuntimeError):
        alloc.allocate()
    assert alloc.num_free == 0 and [alloc.ref_count(b) for b in range(5)] == [1] * 5
    assert alloc.free(got[2]) is True and alloc.num_free == 1
    assert alloc.allocate() == got[2], "the only free block must be the one handed out"


def test_free_blocks_are_handed_out_first_in_first_out():
    alloc = make_block_allocator(6, 4)
    assert [alloc.allocate() for _ in range(4)] == [0, 1, 2, 3], "at the start blocks come in order 0, 1, 2, ..."
    for b in (2, 0, 3):
        alloc.free(b)
    alloc.incref(1)
    alloc.free(1)                                       # still held once: not free
    assert [alloc.allocate() for _ in range(5)] == [4, 5, 2, 0, 3], \
        "never-used blocks first, then freed blocks in the order they were freed (the oldest freed first)"


def test_shared_blocks_are_freed_by_their_last_holder():
    alloc = make_block_allocator(3, 4)
    a = alloc.allocate()
    alloc.incref(a)
    alloc.incref(a)
    assert alloc.ref_count(a) == 3 and alloc.num_free == 2
    assert alloc.free(a) is False and alloc.free(a) is False and alloc.num_free == 2
    assert alloc.free(a) is True and alloc.ref_count(a) == 0 and alloc.num_free == 3
    with pytest.raises(ValueError):
        alloc.free(a)                  # a double free is refused ...
    with pytest.raises(ValueError):
        alloc.incref(a)                # ... and so is sharing a free block
    assert alloc.num_free == 3 and [alloc.ref_count(b) for b in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("seed", range(3))
def test_random_operations_match_a_reference_count_model(seed):
    rng = random.Random(seed)
    n = 6
    alloc, counts = make_block_allocator(n, 2), {}
    state = [lambda: alloc.num_free] + [partial(alloc.ref_count, b) for b in range(n)]    # read after each operation
    for _ in range(300):
        op = rng.choice(["allocate", "incref", "free", "free"])
        held = [b for b, c in counts.items() if c > 0]
        if op == "allocate":
            if len(held) == n:
                with pytest.raises(RuntimeError):
                    alloc.allocate()
                continue
            block, num_free, *refs = script(alloc.allocate, *state)
            assert counts.get(block, 0) == 0, f"block {block} handed out while held"
            counts[block] = 1
        elif held:
            block = rng.choice(held)
            got, num_free, *refs = script(partial(alloc.incref if op == "incref" else alloc.free, block), *state)
            counts[block] += 1 if op == "incref" else -1
            if op == "free":
                assert got is (counts[block] == 0)
        else:
            num_free, *refs = script(*state)
        assert num_free == n - sum(c > 0 for c in counts.values())
        assert refs == [counts.get(b, 0) for b in range(n)]


# --- paged attention ----------------------------------------------------------------------------------


def naive_paged_attention(q, k_pool, v_pool, tables, context_lens, query_lens):
    """Per sequence, per query, per head: softmax over its own keys at positions <= its own."""
    bs, K, H = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    N = q.shape[1]
    out, row = torch.empty(q.shape, dtype=torch.float64), 0
    for table, S, T in zip(tables, context_lens, query_lens):
        keys = torch.stack([k_pool[table[p // bs], p % bs] for p in range(S)]).double()    # (S, K, H)
        values = torch.stack([v_pool[table[p // bs], p % bs] for p in range(S)]).double()
        for t in range(T):
            position = S - T + t
            for n in range(N):
                j = n // (N // K)
                scores = keys[: position + 1, j] @ q[row, n].double() / math.sqrt(H)
                out[row, n] = torch.softmax(scores, 0) @ values[: position + 1, j]
            row += 1
    return out


@pytest.mark.parametrize("seed", range(6))
def test_paged_attention_matches_attention_over_the_gathered_keys(seed):
    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    bs = rng.choice([1, 2, 3, 4, 16])
    K, G, H = rng.choice([1, 2]), rng.choice([1, 3]), 8
    B = rng.randint(1, 5)
    context_lens = [rng.randint(1, 40) for _ in range(B)]
    query_lens = [1] * B if seed % 2 else [rng.randint(1, s) for s in context_lens]   # decodes / ragged prefills
    needed = [math.ceil(s / bs) for s in context_lens]
    num_blocks = sum(needed) + 5
    order = torch.randperm(num_blocks, generator=g).tolist()                          # scattered, out of order
    tables = [order[sum(needed[:b]):sum(needed[:b + 1])] for b in range(B)]
    k_pool, v_pool = torch.randn(num_blocks, bs, K, H, generator=g), torch.randn(num_blocks, bs, K, H, generator=g)
    q = torch.randn(sum(query_lens), K * G, H, generator=g)
    got = run_paged_attention(q, k_pool, v_pool, tables, context_lens, query_lens)
    torch.testing.assert_close(got.double(), naive_paged_attention(q, k_pool, v_pool, tables, context_lens,
                                                                   query_lens), atol=1e-5, rtol=1e-5)


# --- one step of continuous batching ----------------------------------------------------------------------


CASES = {   # running, waiting, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, watermark
    "room_for_all": ([(1, 8), (2, 5), (3, 3)], [(4, 6), (5, 2)], 12, 4, 8, 64, 0),
    "blocks_run_out": ([(1, 8), (2, 5), (3, 3)], [(4, 6), (5, 2)], 8, 4, 8, 64, 0),
    "seat_limit": ([(1, 2)], [(4, 1), (5, 1), (6, 1)], 20, 4, 3, 64, 0),
    "token_budget": ([(1, 2), (2, 2)], [(4, 10), (5, 3)], 20, 4, 8, 12, 0),
    "first_prefill_always_fits_the_budget": ([], [(4, 30), (5, 1)], 20, 4, 8, 16, 0),
    "watermark": ([(1, 3)], [(4, 8)], 4, 4, 8, 64, 2),          # 2 blocks + 2 kept free > 3 free
    "preempt_the_youngest": ([(1, 8), (2, 8), (3, 4)], [(4, 6)], 6, 4, 8, 64, 0),
    "preempt_twice": ([(1, 4), (2, 1), (3, 1)], [], 3, 4, 8, 64, 0),
    "preempt_itself": ([(1, 2), (2, 4)], [(9, 1)], 2, 4, 8, 64, 0),
}


@pytest.mark.parametrize("name", CASES)
def test_continuous_batching_step_by_hand(name):
    got = run_continuous_batching_step(*CASES[name])
    want = ref_step(*CASES[name])
    assert {k: (list(v) if isinstance(v, (list, tuple)) else int(v)) for k, v in got.items()} == want


def test_random_steps_match_the_rules():
    rng = random.Random(0)
    for trial in range(150):
        bs = rng.choice([1, 2, 4])
        running = [(i, rng.randint(1, 12)) for i in range(rng.randint(0, 6))]
        waiting = [(100 + i, rng.randint(1, 12)) for i in range(rng.randint(0, 5))]
        used = sum(-(-n // bs) for _, n in running)
        case = (running, waiting, used + rng.randint(1, 6), bs, rng.randint(1, 10), rng.randint(4, 40),
                rng.randint(0, 2))
        got = run_continuous_batching_step(*case)
        got = {k: (list(v) if isinstance(v, (list, tuple)) else int(v)) for k, v in got.items()}
        assert got == ref_step(*case), f"trial {trial}: {case}"
