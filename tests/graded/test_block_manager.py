"""Graded: block tables over one pool (BlockManager: fork, copy-on-write, append) and continuous batching run
to completion (continuous_batching_run). References are written here: a model of the tables, the reference
counts and a first-in-first-out free list; the scheduling rules as a loop (reference_serving)."""

import random
from functools import partial

import pytest
from adapters import make_paged_block_manager, run_continuous_batching_run, script
from reference_serving import ref_run


class RefManager:
    """Tables, counts and a FIFO free list, as the docstrings define them."""

    def __init__(self, num_blocks, bs):
        self.bs, self.free_list, self.counts, self.tables, self.tokens = bs, list(range(num_blocks)), {}, {}, {}

    def _take(self):
        block = self.free_list.pop(0)
        self.counts[block] = 1
        return block

    def _drop(self, block):
        self.counts[block] -= 1
        if self.counts[block] == 0:
            del self.counts[block]
            self.free_list.append(block)

    def allocate(self, seq, n):
        self.tables[seq] = [self._take() for _ in range(-(-n // self.bs))]
        self.tokens[seq] = n

    def needs_block(self, seq):
        return self.tokens[seq] == len(self.tables[seq]) * self.bs or self.counts[self.tables[seq][-1]] > 1

    def append(self, seq):
        table, copy = self.tables[seq], None
        if self.tokens[seq] == len(table) * self.bs:
            table.append(self._take())
        elif self.counts[table[-1]] > 1:
            shared = table[-1]
            table[-1] = self._take()
            self._drop(shared)
            copy = (shared, table[-1])
        self.tokens[seq] += 1
        return copy

    def fork(self, parent, child):
        self.tables[child], self.tokens[child] = list(self.tables[parent]), self.tokens[parent]
        for block in self.tables[child]:
            self.counts[block] += 1

    def release(self, seq):
        for block in reversed(self.tables.pop(seq)):
            self._drop(block)
        del self.tokens[seq]


def _state(manager, ref) -> list:
    """The steps that read the manager's state: its free blocks, every live table, the count of every block used."""
    blocks = range(len(ref.free_list) + len(ref.counts))
    return ([lambda: manager.num_free_blocks] + [partial(manager.block_table, seq) for seq in ref.tables]
            + [partial(manager.ref_count, block) for block in blocks])


def _check_state(got, ref, what):
    """`got`: what the steps of `_state` returned."""
    assert got[0] == len(ref.free_list), f"{what}: free blocks"
    tables, counts = got[1:1 + len(ref.tables)], got[1 + len(ref.tables):]
    for (seq, table), g in zip(ref.tables.items(), tables):
        assert list(g) == table, f"{what}: table of {seq}"
    for block, g in enumerate(counts):
        assert g == ref.counts.get(block, 0), f"{what}: count of block {block}"


def _same(manager, ref, what):
    _check_state(script(*_state(manager, ref)), ref, what)


def test_fork_shares_every_block_and_the_first_write_copies_the_shared_last_block():
    m = make_paged_block_manager(8, 4)
    assert m.allocate(0, 6) == [0, 1]
    m.fork(0, 1)
    assert m.block_table(1) == [0, 1] and m.ref_count(0) == m.ref_count(1) == 2 and m.num_free_blocks == 6
    assert m.append_needs_block(1), "its last block is shared: the next token needs a private copy"
    assert tuple(m.append_slot(1)) == (1, 2), "copy block 1 into the fresh block 2 before writing"
    assert m.block_table(1) == [0, 2] and m.block_table(0) == [0, 1], "the other holder keeps its block"
    assert m.ref_count(1) == 1 and m.ref_count(2) == 1 and m.ref_count(0) == 2
    assert not m.append_needs_block(0), "block 1 is sequence 0's alone now, with room left"
    assert m.append_slot(0) is None and m.append_slot(0) is None and m.block_table(0) == [0, 1]
    assert m.append_needs_block(0) and m.append_slot(0) is None and m.block_table(0) == [0, 1, 3]
    m.free(0)
    assert m.ref_count(0) == 1 and m.ref_count(1) == 0 and m.num_free_blocks == 6


def test_a_full_shared_last_block_needs_a_new_block_not_a_copy():
    m = make_paged_block_manager(6, 2)
    m.allocate(7, 4)                                       # two full blocks
    m.fork(7, 8)
    assert m.append_needs_block(8) and m.append_slot(8) is None, "nothing to copy: a fresh block for position 4"
    assert m.block_table(8) == [0, 1, 2] and m.block_table(7) == [0, 1]


def test_refused_calls_change_nothing():
    m = make_paged_block_manager(3, 2)
    m.allocate(0, 4)
    m.fork(0, 1)
    before = (m.block_table(0), m.block_table(1), m.num_free_blocks, [m.ref_count(b) for b in range(3)])
    for bad, error in [(lambda: m.allocate(2, 5), RuntimeError), (lambda: m.allocate(0, 1), ValueError),
                       (lambda: m.fork(0, 1), ValueError), (lambda: m.fork(9, 3), ValueError),
                       (lambda: m.free(9), ValueError)]:
        with pytest.raises(error):
            bad()
        assert (m.block_table(0), m.block_table(1), m.num_free_blocks, [m.ref_count(b) for b in range(3)]) == before
    m.append_slot(0)
    with pytest.raises(RuntimeError):
        m.append_slot(1)                                   # no free block left for its new block
    assert m.block_table(1) == [0, 1] and m.num_free_blocks == 0


@pytest.mark.parametrize("seed", range(3))
def test_random_operations_match_the_table_model(seed):
    rng = random.Random(seed)
    n, bs = 10, rng.choice([1, 2, 3])
    m, ref, next_id = make_paged_block_manager(n, bs), RefManager(n, bs), 0
    for step in range(250):
        op, live = rng.choice(["allocate", "append", "append", "append", "fork", "free"]), list(ref.tables)
        if op == "allocate":
            tokens = rng.randint(1, 3 * bs)
            if -(-tokens // bs) > len(ref.free_list):
                continue
            ops = [partial(m.allocate, next_id, tokens)]
            ref.allocate(next_id, tokens)
            next_id += 1
        elif op == "fork" and live:
            parent = rng.choice(live)
            ops = [partial(m.fork, parent, next_id)]
            ref.fork(parent, next_id)
            next_id += 1
        elif op == "append" and live:
            seq = rng.choice(live)
            needs = ref.needs_block(seq)
            if needs and not ref.free_list:
                assert m.append_needs_block(seq) == needs, f"step {step}: append_needs_block({seq})"
                continue
            ops, want = [partial(m.append_needs_block, seq), partial(m.append_slot, seq)], ref.append(seq)
        elif op == "free" and live:
            seq = rng.choice(live)
            ops = [partial(m.free, seq)]
            ref.release(seq)
        else:
            ops = []
        got = script(*ops, *_state(m, ref))          # the operation and the state after it, in one message
        if op == "append" and ops:
            assert got[0] == needs, f"step {step}: append_needs_block({seq})"
            assert (None if got[1] is None else tuple(got[1])) == want, f"step {step}: append_slot({seq})"
        _check_state(got[len(ops):], ref, f"step {step} ({op})")


# requests (prompt_len, max_new_tokens), num_blocks, block_size, max_num_seqs, max_num_batched_tokens, watermark
RUNS = {
    "plenty": ([(5, 3), (2, 4), (7, 1), (3, 2)], 20, 4, 8, 64, 0),
    "seats": ([(3, 2), (2, 3), (4, 2), (1, 4), (2, 1)], 30, 2, 2, 64, 0),
    "token_budget": ([(6, 2), (5, 3), (4, 2), (9, 1)], 30, 4, 8, 10, 1),
    "preemption": ([(4, 6), (4, 6), (3, 5)], 6, 2, 8, 64, 0),
    "one_token_each": ([(2, 1), (3, 1), (1, 1)], 4, 2, 1, 64, 0),
}


@pytest.mark.parametrize("name", RUNS)
def test_a_run_to_completion_follows_the_rules_step_by_step(name):
    got = run_continuous_batching_run(*RUNS[name])
    want = ref_run(*RUNS[name])
    got = [{k: list(v) for k, v in step.items()} for step in got]
    assert len(got) == len(want), f"{len(got)} steps, want {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"step {i}: got {a}, want {b}"


def test_random_runs_match_the_rules():
    rng = random.Random(1)
    for trial in range(25):
        bs = rng.choice([1, 2, 4])
        requests = [(rng.randint(1, 8), rng.randint(1, 5)) for _ in range(rng.randint(1, 6))]
        watermark = rng.randint(0, 1)
        need = max(-(-(p + t) // bs) for p, t in requests) + watermark
        case = (requests, need + rng.randint(0, 6), bs, rng.randint(1, 4), rng.randint(4, 20), watermark)
        got = [{k: list(v) for k, v in step.items()} for step in run_continuous_batching_run(*case)]
        assert got == ref_run(*case), f"trial {trial}: {case}"
