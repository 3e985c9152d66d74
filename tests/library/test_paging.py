"""Paged KV memory of the library: block allocator (its free-list order, argument checks), block tables
(fork, copy-on-write), prefix sharing, the contiguous baseline, and paged attention's kernel options
against a naive per-position reference written here. (The allocator's counts, paged attention and a
continuous-batching step are graded in tests/graded/test_paged_serving.py.)"""

from __future__ import annotations

import math
import random

import pytest
import torch

import adapters

from cs336_inference.serving import BlockAllocator, paged_attention

OutOfBlocksError = adapters.get_out_of_blocks_error()


# --- block allocator ------------------------------------------------------------------------------

def test_allocator_counts_and_free_list():
    alloc = BlockAllocator(4, 16)
    a, b = alloc.allocate(), alloc.allocate()
    assert a != b and alloc.num_free == 2 and alloc.num_used == 2
    alloc.incref(a)
    assert alloc.ref_count(a) == 2
    assert alloc.free(a) is False and alloc.ref_count(a) == 1  # still held by one table
    assert alloc.free(a) is True and alloc.is_free(a)
    assert alloc.num_free + alloc.num_used == 4
    # least recently freed first: a went to the back, so the two never-used blocks come first
    assert alloc.allocate() not in (a, b)


@pytest.mark.parametrize("num_blocks, block_size, error", [
    (4, 0, ValueError), (4, -1, ValueError), (0, 4, ValueError), (4, 2.0, TypeError), (True, 4, TypeError)])
def test_allocator_rejects_bad_sizes(num_blocks, block_size, error):
    with pytest.raises(error, match="num_blocks|block_size"):
        BlockAllocator(num_blocks, block_size)


def test_allocator_errors_leave_state_intact():
    alloc = BlockAllocator(2, 4)
    a = alloc.allocate()
    alloc.free(a)
    before = (alloc.free_blocks(), [alloc.ref_count(i) for i in range(2)])
    with pytest.raises(ValueError, match="double free"):
        alloc.free(a)
    with pytest.raises(ValueError, match="block must be an int in"):
        alloc.free(7)
    with pytest.raises(ValueError, match="free"):
        alloc.incref(a)
    assert (alloc.free_blocks(), [alloc.ref_count(i) for i in range(2)]) == before
    alloc.allocate(), alloc.allocate()
    with pytest.raises(OutOfBlocksError, match="out of KV blocks"):
        alloc.allocate()
    assert alloc.num_free == 0 and [alloc.ref_count(i) for i in range(2)] == [1, 1]


# --- block manager: fork, copy-on-write, prefix sharing, errors --------------------------------------

def _snapshot(m):
    return ({sid: (list(t.blocks), t.num_tokens) for sid, t in m.tables.items()},
            m.pool.free_blocks(), [m.pool.ref_count(b) for b in range(m.pool.num_blocks)])


def test_fork_then_copy_on_write_keeps_the_parent_intact():
    m = adapters.make_kv_cache_manager(8, 4)
    m.allocate("p", [1, 2, 3, 4, 5])            # blocks: [full, 1 token]
    m.fork("p", "c")
    assert m.tables["c"].blocks == m.tables["p"].blocks
    shared_last = m.tables["p"].blocks[-1]
    assert m.pool.ref_count(shared_last) == 2
    (copy,) = m.allocate_slots("c")             # the child writes into the shared last block
    assert copy[0] == shared_last and copy[1] != shared_last
    assert m.tables["c"].blocks[-1] == copy[1] and m.tables["p"].blocks[-1] == shared_last
    assert m.pool.ref_count(shared_last) == 1
    assert m.allocate_slots("p") == []          # the parent now owns its block alone: no copy
    assert m.tables["p"].blocks[0] == m.tables["c"].blocks[0]  # the full block stays shared
    m.check_invariants()


def test_prefix_sharing_reuses_full_blocks_and_skips_them():
    m = adapters.make_kv_cache_manager(16, 4)
    system = list(range(10, 22))                 # 12 tokens = 3 full blocks
    assert m.allocate("a", system + [1, 2]) == 0
    m.cache_blocks("a", system + [1, 2])
    cached = m.allocate("b", system + [3])       # 13 tokens: the 3 system blocks are cached
    assert cached == 12
    assert m.tables["b"].blocks[:3] == m.tables["a"].blocks[:3]
    # the block of the last token is never taken from the cache: one token is left to run
    assert m.allocate("c", system) == 8
    # a different earlier block changes every later block's identity: no hit after it
    assert m.allocate("d", [99] + system[1:] + [3]) == 0
    m.free("a"), m.free("b")
    # freed blocks keep their contents until reused: still a hit
    assert m.allocate("e", system + [5]) == 12
    m.check_invariants()


def test_prefix_cache_never_shares_on_hash_collision():
    m = adapters.make_kv_cache_manager(16, 2, hash_fn=lambda parent, tokens: 0)  # every block collides
    m.allocate("a", [1, 2, 3, 4, 5])
    m.cache_blocks("a", [1, 2, 3, 4, 5])
    assert m.allocate("b", [7, 8, 3, 4, 5]) == 0  # same second block, different first: no share
    assert m.allocate("c", [1, 2, 9]) == 0        # the table slot now names a's 2nd block: a miss
    m.check_invariants()


def test_manager_errors_leave_state_intact():
    m = adapters.make_kv_cache_manager(3, 2)
    m.allocate("a", [1, 2, 3])                   # 2 blocks
    before = _snapshot(m)
    with pytest.raises(OutOfBlocksError):
        m.allocate("b", [1, 2, 3, 4, 5])          # needs 3, 1 free
    with pytest.raises(ValueError, match="unknown sequence"):
        m.free("nope")
    with pytest.raises(ValueError, match="already has"):
        m.allocate("a", [1])
    with pytest.raises(ValueError, match="token_ids"):
        m.allocate("z", [])
    assert _snapshot(m) == before
    m.allocate_slots("a")
    m.allocate_slots("a")                         # third block: pool full
    m.allocate_slots("a")                         # 6 tokens in 3 blocks of 2
    before = _snapshot(m)
    with pytest.raises(OutOfBlocksError):
        m.allocate_slots("a")
    with pytest.raises(OutOfBlocksError):
        m.allocate_slots("a", 3)
    assert _snapshot(m) == before
    m.free("a")
    with pytest.raises(ValueError, match="unknown sequence"):
        m.free("a")                               # double free of a sequence
    assert m.pool.num_free == 3


def _kv_value(tokens: list[int], position: int) -> int:
    """What the 'K/V' of `position` would be: a function of every token up to it (as in a model)."""
    h = 17
    for t in tokens[: position + 1]:
        h = (h * 1_000_003 + t + 1) % (2**61 - 1)
    return h


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["prefix", "no_prefix", "colliding_hash"])
def test_block_manager_invariants_under_random_operations(seed, mode):
    """Allocate / append / fork / free in a random order with a pool that holds one value per slot
    (a function of the whole prefix). After every operation: reference counts equal the number of
    tables holding each block, free + used = total, and every sequence reads back exactly its own
    values (copy-on-write and prefix sharing never show it another sequence's data)."""
    rng = random.Random(seed)
    num_blocks, bs = 24, rng.choice([1, 2, 4])
    hash_fn = (lambda parent, tokens: len(tokens)) if mode == "colliding_hash" else None
    m = adapters.make_kv_cache_manager(num_blocks, bs, prefix_caching=mode != "no_prefix", hash_fn=hash_fn)
    pool = [None] * (num_blocks * bs)
    expected: dict[int, list[int]] = {}         # the test's own record of every live sequence
    history: list[list[int]] = [[rng.randrange(3) for _ in range(9)]]
    hits = copies = 0

    def write(sid, positions):
        table = m.tables[sid]
        for p in positions:
            block = table.blocks[p // bs]
            assert m.pool.ref_count(block) == 1, "a write must go to a block no one else holds"
            pool[table.slot(p)] = _kv_value(expected[sid], p)

    for step in range(300):
        op = rng.choices(["alloc", "append", "fork", "free"], [3, 6, 2, 2])[0]
        live = sorted(expected)
        before = _snapshot(m)
        if op == "alloc" or not live:
            sid = step + 1000
            base = rng.choice(history)
            tokens = base[: rng.randint(0, len(base))] + [rng.randrange(3) for _ in range(rng.randint(1, 3 * bs))]
            try:
                cached = m.allocate(sid, tokens)
            except OutOfBlocksError:
                assert _snapshot(m) == before
                continue
            assert cached % bs == 0 and 0 <= cached < len(tokens)
            hits += cached > 0
            expected[sid] = list(tokens)
            write(sid, range(cached, len(tokens)))
            m.cache_blocks(sid, tokens)
            history.append(tokens)
        elif op == "append":
            sid = rng.choice(live)
            token = rng.randrange(3)
            try:
                block_copies = m.allocate_slots(sid)
            except OutOfBlocksError:
                assert _snapshot(m) == before
                continue
            for src, dst in block_copies:
                pool[dst * bs:(dst + 1) * bs] = pool[src * bs:(src + 1) * bs]
                copies += 1
            expected[sid].append(token)
            write(sid, [len(expected[sid]) - 1])
            m.cache_blocks(sid, expected[sid])
        elif op == "fork":
            parent, child = rng.choice(live), step + 1000
            m.fork(parent, child)
            expected[child] = list(expected[parent])
        else:
            sid = rng.choice(live)
            m.free(sid)
            history.append(expected.pop(sid))

        m.check_invariants()
        counts = [0] * num_blocks                 # independent recount of the holders
        for sid in expected:
            for block in m.tables[sid].blocks:
                counts[block] += 1
        assert counts == [m.pool.ref_count(b) for b in range(num_blocks)]
        assert m.pool.num_free == sum(c == 0 for c in counts)
        assert set(m.tables) == set(expected)
        for sid, tokens in expected.items():
            table = m.tables[sid]
            assert len(table.blocks) == math.ceil(len(tokens) / bs)
            got = [pool[table.slot(p)] for p in range(len(tokens))]
            assert got == [_kv_value(tokens, p) for p in range(len(tokens))], f"sequence {sid} reads wrong data"
    for sid in list(expected):
        m.free(sid)
    assert m.pool.num_free == num_blocks and not m.tables
    assert copies > 0 or bs == 1  # a block of one token is never partly filled, so never copied
    if mode == "prefix":
        assert hits > 0


# --- contiguous baseline and memory statistics -----------------------------------------------------

def test_contiguous_allocator_fragments_and_refuses_cleanly():
    c = adapters.make_contiguous_allocator(10)
    assert c.allocate("a", 4, num_used=1) == 0
    assert c.allocate("b", 3, num_used=3) == 4
    assert c.allocate("c", 3, num_used=2) == 7
    c.free("a"), c.free("c")
    stats = c.memory_stats()
    assert (stats.free_tokens, stats.largest_free_tokens, stats.external_fragmentation_tokens) == (7, 4, 3)
    before = dict(c.regions)
    with pytest.raises(OutOfBlocksError, match="no free run of 5"):
        c.allocate("d", 5)                    # 7 slots free, none 5 in a row
    assert c.regions == before
    assert c.allocate("d", 2, num_used=1) == 0  # first fit
    stats = c.memory_stats()
    assert (stats.reserved_tokens, stats.used_tokens, stats.internal_fragmentation_tokens) == (5, 4, 1)
    with pytest.raises(ValueError, match="unknown sequence"):
        c.free("zz")
    with pytest.raises(ValueError, match="more than the 2 slots"):
        c.append("d", 2)


def test_paged_memory_waste_is_below_one_block_per_sequence():
    rng = random.Random(0)
    m = adapters.make_kv_cache_manager(200, 16, prefix_caching=False)
    lengths = [rng.randint(1, 100) for _ in range(20)]
    for i, n in enumerate(lengths):
        m.allocate(i, [1] * n)
    stats = m.memory_stats()
    assert stats.used_tokens == stats.logical_tokens == sum(lengths)
    assert stats.reserved_tokens == 16 * sum(math.ceil(n / 16) for n in lengths)
    assert stats.internal_fragmentation_tokens < 16 * len(lengths)
    assert stats.external_fragmentation_tokens == 0


def test_memory_stats_count_shared_blocks_once():
    m = adapters.make_kv_cache_manager(16, 4)
    m.allocate("a", list(range(10)))
    m.fork("a", "b")
    stats = m.memory_stats()
    assert (stats.logical_tokens, stats.used_tokens, stats.reserved_tokens) == (20, 10, 12)
    assert stats.shared_tokens == 10


# --- paged attention --------------------------------------------------------------------------------

def _naive_attention(q, k_pool, v_pool, tables, context_lens, query_lens):
    """Per sequence, per query, per head: softmax over the keys at positions <= its own."""
    bs, K, H = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    N = q.shape[1]
    out, row = torch.empty_like(q), 0
    for table, S, T in zip(tables, context_lens, query_lens):
        keys = torch.stack([k_pool[table[p // bs], p % bs] for p in range(S)])    # (S, K, H)
        values = torch.stack([v_pool[table[p // bs], p % bs] for p in range(S)])
        for t in range(T):
            position = S - T + t
            for n in range(N):
                kv = n // (N // K)
                scores = keys[: position + 1, kv] @ q[row, n] / math.sqrt(H)
                out[row, n] = torch.softmax(scores, 0) @ values[: position + 1, kv]
            row += 1
    return out


@pytest.mark.parametrize("kernel", ["reference", "sdpa"])
@pytest.mark.parametrize("seed", range(8))
def test_paged_attention_matches_naive_attention(seed, kernel):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 3, 4, 16])
    K, G, H = rng.choice([1, 2]), rng.choice([1, 3]), 8
    B = rng.randint(1, 5)
    context_lens = [rng.randint(1, 40) for _ in range(B)]
    query_lens = ([1] * B if seed % 2 else [rng.randint(1, s) for s in context_lens])  # decode / ragged prefill
    needed = [math.ceil(s / bs) for s in context_lens]
    num_blocks = sum(needed) + 5
    order = torch.randperm(num_blocks, generator=g).tolist()    # scattered, out of order
    tables, used = [], 0
    for n in needed:
        tables.append(order[used:used + n])
        used += n
    k_pool = torch.randn(num_blocks, bs, K, H, generator=g)
    v_pool = torch.randn(num_blocks, bs, K, H, generator=g)
    q = torch.randn(sum(query_lens), K * G, H, generator=g)
    got = paged_attention(q, k_pool, v_pool, tables, context_lens, query_lens, kernel=kernel)
    want = _naive_attention(q, k_pool, v_pool, tables, context_lens, query_lens)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_paged_attention_refuses_short_block_tables():
    k = torch.zeros(4, 2, 1, 8)
    with pytest.raises(ValueError, match="maps only 1 blocks"):
        paged_attention(torch.zeros(1, 1, 8), k, k, [[0]], [3])


def test_contiguous_manager_reserves_every_sample_and_copies_on_fork():
    m = adapters.make_contiguous_manager(30)
    assert m.can_allocate([1, 2, 3], max_len=10, num_samples=3) and not m.can_allocate([1], 10, num_samples=4)
    assert m.allocate("a", [1, 2, 3], max_len=10, num_samples=2) == 0   # no prefix cache
    assert m.memory_stats().reserved_tokens == 20                        # its run + one for a sibling
    copies = m.fork("a", "b")
    assert copies == list(zip(m.table("a").blocks, m.table("b").blocks)) and len(copies) == 3
    assert set(m.table("a").blocks).isdisjoint(m.table("b").blocks)      # nothing shared
    with pytest.raises(OutOfBlocksError, match="no reserved run"):
        m.fork("a", "c")
    assert m.append_needs_block("a") is False and m.allocate_slots("a") == []
    assert m.table("a").blocks == list(range(m.table("a").blocks[0], m.table("a").blocks[0] + 4))
    m.free("a"), m.free("b")
    assert m.memory_stats().reserved_tokens == 0 and m.num_free_blocks == 30


@pytest.mark.parametrize("kernel", ["reference", "sdpa"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_paged_attention_never_reads_padding_as_data(kernel, poison):
    """Block 0 pads the shorter tables of a batch and the last block of a sequence has slots past its
    length: whatever they hold (NaN, inf, another sequence's keys) must not reach any output."""
    g = torch.Generator().manual_seed(0)
    bs, K, H = 4, 2, 8
    k_pool, v_pool = torch.randn(12, bs, K, H, generator=g), torch.randn(12, bs, K, H, generator=g)
    tables, context_lens, query_lens = [[3, 5, 7], [2], [9, 4]], [10, 3, 6], [1, 1, 4]
    q = torch.randn(sum(query_lens), 2 * K, H, generator=g)
    want = _naive_attention(q, k_pool, v_pool, tables, context_lens, query_lens)
    for pool in (k_pool, v_pool):
        pool[0] = poison                                   # the padding block, held by nobody
        pool[7, 2:] = poison                               # past position 10 in sequence 0's last block
        pool[2, 3:] = poison
        pool[4, 2:] = -poison
    got = paged_attention(q, k_pool, v_pool, tables, context_lens, query_lens, kernel=kernel)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_paged_attention_refuses_bad_tables_and_lengths():
    k = torch.zeros(4, 2, 1, 8)
    q = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="twice"):
        paged_attention(q, k, k, [[1, 1]], [3])           # two positions in one slot
    with pytest.raises(ValueError, match=r"outside the pool's \[0, 4\)"):
        paged_attention(q, k, k, [[1, 9]], [3])
    with pytest.raises(ValueError, match="outside"):
        paged_attention(q, k, k, torch.tensor([[-1, 2]]), [3])
    with pytest.raises(TypeError, match="context_lens"):
        paged_attention(q, k, k, [[1, 2]], [3.7])          # never truncated to 3
    with pytest.raises(TypeError, match="context_lens"):
        paged_attention(q, k, k, [[1, 2]], torch.tensor([3.0]))
    with pytest.raises(TypeError, match="block_tables"):
        paged_attention(q, k, k, [[1.0, 2.0]], [3])
    assert paged_attention(q, k, k, torch.tensor([[1, 2, 0]]), [3]).shape == (1, 1, 8)  # unused padding may repeat


def test_a_preempted_sequence_keeps_the_cached_prompt_tokens_of_its_first_admission():
    """num_cached_tokens counts the prompt tokens a request took from the prefix cache when first admitted
    (what its output reports). Preempted and readmitted, a sequence finds more of its own blocks still
    cached (here 16 tokens); that recompute must not overwrite the first admission's count (8: the two full
    blocks of 4 it shared with the other request's prompt)."""
    from cs336_inference.serving import ContinuousScheduler, KVCacheManager, Request, Sequence

    block_size, shared = 4, list(range(1, 9))
    manager = KVCacheManager(7, block_size)
    scheduler = ContinuousScheduler(manager, max_num_seqs=4, max_num_batched_tokens=64, watermark_blocks=0)
    first = Sequence("first", Request("first", tuple(shared), 12))
    second = Sequence("second", Request("second", tuple(shared + [20, 21]), 12))
    scheduler.add(first)
    admissions = []
    for step in range(60):
        if step == 1:
            scheduler.add(second)
        if not scheduler.has_unfinished():
            break
        batch = scheduler.schedule(now=float(step))
        admissions += [(s.seq_id, s.num_computed_tokens) for s in batch.prefills]
        scheduler.postprocess(batch, [[50] * batch.samples_wanted(s) for s in batch.sequences], now=float(step))
    expected = len(shared) // block_size * block_size
    assert second.num_preemptions >= 1 and len(second.output) == 12
    readmitted = [n for seq_id, n in admissions if seq_id == "second"]
    assert readmitted[0] == expected and readmitted[-1] != expected      # the readmission found a different count
    assert second.num_cached_tokens == expected


def _run_scheduler(scheduler, arrivals: dict[int, list], steps: int, on_step=None) -> None:
    """Drive `scheduler` with a fixed sampled token (50): `arrivals` {step: sequences added then};
    `on_step(step, batch)` sees each schedule() before its postprocess."""
    for step in range(steps):
        for seq in arrivals.get(step, []):
            scheduler.add(seq)
        if not scheduler.has_unfinished():
            return
        batch = scheduler.schedule(now=float(step))
        if on_step is not None:
            on_step(step, batch)
        scheduler.postprocess(batch, [[50] * batch.samples_wanted(s) for s in batch.sequences], now=float(step))


def test_a_chunked_prefill_names_only_the_blocks_its_chunks_have_computed():
    """A 22-token prompt prefilled in chunks of 8 (block size 4): after chunk k the prompt's first 8k tokens
    hold K/V, so the prefix cache may offer floor(min(8k, 22) / 4) full blocks of it and no more. Naming
    the blocks of later chunks early would let a preempted or sharing sequence take blocks never written."""
    from cs336_inference.serving import ContinuousScheduler, KVCacheManager, Request, Sequence

    block_size, chunk, prompt = 4, 8, list(range(1, 23))
    manager = KVCacheManager(16, block_size)
    scheduler = ContinuousScheduler(manager, max_num_seqs=4, max_num_batched_tokens=chunk, watermark_blocks=0,
                                    chunked_prefill=True)
    seq = Sequence("long", Request("long", tuple(prompt), 2))
    seen = []

    def after_schedule(step, batch):
        computed = min(chunk * (step + 1), len(prompt))   # this step's chunk included (written in its forward)
        seen.append((manager.num_cached_tokens(prompt), computed // block_size * block_size))

    _run_scheduler(scheduler, {0: [seq]}, steps=3, on_step=after_schedule)
    assert len(seen) == 3 and seen[0][1] == 8 and seen[-1][1] == 20
    for got, expected in seen:
        assert got == expected


def test_a_preempted_sequence_goes_back_to_the_front_of_the_waiting_queue():
    """Recompute preemption (as vLLM): the preempted sequence arrived before everything still waiting, so it
    must be readmitted before them; the waiting queue stays in arrival order. Here three 4-token prompts share
    a 4-block pool: a and b run, c waits; when a needs a second block, b (the youngest running) is preempted,
    and the next sequence admitted must be b, not c."""
    from cs336_inference.serving import ContinuousScheduler, KVCacheManager, Request, Sequence

    manager = KVCacheManager(4, 4, prefix_caching=False)
    scheduler = ContinuousScheduler(manager, max_num_seqs=2, max_num_batched_tokens=64, watermark_blocks=0)
    seqs = [Sequence(name, Request(name, (10 + i, 11 + i, 12 + i, 13 + i), 8, arrival_time=float(i)))
            for i, name in enumerate("abc")]
    preempted, admitted_after = [], []

    def watch(step, batch):
        if batch.preempted:
            preempted.extend(s.seq_id for s in batch.preempted)
            arrivals = [s.request.arrival_time for s in scheduler.waiting]
            assert arrivals == sorted(arrivals), [s.seq_id for s in scheduler.waiting]
        elif preempted:
            admitted_after.extend(s.seq_id for s in batch.prefills if s.num_computed_tokens == 0)

    _run_scheduler(scheduler, {0: seqs[:2], 1: seqs[2:]}, steps=80, on_step=watch)
    assert preempted and preempted[0] == "b"
    assert admitted_after[0] == "b"
    assert all(len(s.output) == 8 for s in seqs)


def test_a_prefill_preempted_between_chunks_takes_back_only_blocks_it_computed():
    """The consequence of naming blocks early: a 20-token prompt, prefilled in chunks under a budget of 8 while
    a short request decodes, is preempted (the pool of 6 blocks of 4 runs out) after computing only its first
    chunk. Its freed blocks stay in the prefix cache; readmitted, it may take from there only the full blocks
    whose K/V its chunks wrote (floor(computed / 4) of them), never blocks of the prompt it had not reached."""
    from cs336_inference.serving import ContinuousScheduler, KVCacheManager, Request, Sequence

    block_size = 4
    manager = KVCacheManager(6, block_size)
    scheduler = ContinuousScheduler(manager, max_num_seqs=4, max_num_batched_tokens=8, watermark_blocks=0,
                                    chunked_prefill=True)
    short = Sequence("short", Request("short", (1, 2, 3), 12))
    long = Sequence("long", Request("long", tuple(range(100, 120)), 2, arrival_time=1.0))
    computed, admissions = {"long": 0}, []

    def watch(step, batch):
        for s in batch.preempted:
            admissions.append(("preempted", computed[s.seq_id]))
            computed[s.seq_id] = 0
        for s in batch.prefills:
            if s.seq_id == "long":
                if s.num_computed_tokens == 0 or not admissions or admissions[-1][0] == "preempted":
                    admissions.append(("admitted", s.num_computed_tokens))
                computed["long"] = s.num_computed_tokens + batch.num_scheduled_tokens["long"]

    _run_scheduler(scheduler, {0: [short], 1: [long]}, steps=80, on_step=watch)
    assert long.num_preemptions >= 1 and len(long.output) == 2 and len(short.output) == 12
    kinds = [k for k, _ in admissions]
    assert "preempted" in kinds and kinds.index("preempted") + 1 < len(kinds)
    for (kind, n), (next_kind, cached) in zip(admissions, admissions[1:]):
        if kind == "preempted":
            assert 0 < n < len(long.request.prompt)                      # preempted between chunks
            assert next_kind == "admitted" and cached <= n // block_size * block_size, admissions
