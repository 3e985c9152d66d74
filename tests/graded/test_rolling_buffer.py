"""Graded: the sliding-window layer's rolling buffer (RollingKVCache). The reference is a simulation
written here: which position each ring slot holds (slot p % capacity), and every value ever written."""

from functools import partial

import pytest
import torch
from adapters import make_graded_rolling_kv_cache, script, watching
from write_checks import DuplicateWrites

B, K, H = 2, 2, 4


class RefRing:
    """What a ring of `capacity` slots holds: slot -> position last written there, position -> (k, v)."""

    def __init__(self, window, capacity):
        self.window, self.capacity, self.length = window, capacity, 0
        self.slot, self.kv = {}, {}

    def append(self, k, v):
        T = k.shape[2]
        for t in range(T):
            p = self.length + t
            if t >= T - self.capacity:       # a long append keeps only its last `capacity` positions
                self.slot[p % self.capacity] = p
            self.kv[p] = (k[:, :, t], v[:, :, t])
        self.length += T

    def needed(self, n):
        return range(max(0, n - self.window + 1), n)

    def can_truncate(self, n):
        return all(self.slot.get(p % self.capacity) == p for p in self.needed(n))

    def context(self):
        ps = list(self.needed(self.length))
        if not ps:
            return torch.zeros(B, K, 0, H), torch.zeros(B, K, 0, H)
        return (torch.stack([self.kv[p][0] for p in ps], 2), torch.stack([self.kv[p][1] for p in ps], 2))


def _check_context(buffer, ref, what, op=None):
    """The buffer's context and length (after `op`, a step that changes it, sent with the reads) against the ring's."""
    (k, v), length = script(*([op] if op else []), buffer.context, lambda: buffer.length)[-2:]
    want_k, want_v = ref.context()
    assert length == ref.length, f"{what}: length {length}, want {ref.length}"
    assert k.shape == want_k.shape, f"{what}: context holds {k.shape[2]} positions, want {want_k.shape[2]}"
    torch.testing.assert_close(k, want_k, atol=0, rtol=0, msg=f"{what}: context keys differ")
    torch.testing.assert_close(v, want_v, atol=0, rtol=0, msg=f"{what}: context values differ")


def _kv(T, g):
    return torch.randn(B, K, T, H, generator=g), torch.randn(B, K, T, H, generator=g)


def test_appends_wrap_around_and_the_context_is_the_last_window():
    g = torch.Generator().manual_seed(0)
    buffer, ref = make_graded_rolling_kv_cache(B, K, H, 4, 4), RefRing(4, 4)
    for T in [1, 2, 3, 1, 1, 5, 1, 9, 1]:     # T = 9 > capacity: only the last 4 positions survive
        k, v = _kv(T, g)
        buffer.append(k, v)
        ref.append(k, v)
        _check_context(buffer, ref, f"after appending {T} (length {ref.length})")


def test_a_second_rollback_after_the_ring_wrapped_is_refused():
    """Window 4, 6 slots (2 spare). Positions 10-12 are verified then rejected: their writes overwrote
    positions 4-6. Rolling back to 10 is fine (7-9 intact); after one more token, rolling back to 8 needs
    position 5 again, whose slot now holds the rejected position 11: refused, nothing changes."""
    g = torch.Generator().manual_seed(1)
    buffer, ref = make_graded_rolling_kv_cache(B, K, H, 4, 6), RefRing(4, 6)
    for T in (10, 3):
        kv = _kv(T, g)
        buffer.append(*kv)
        ref.append(*kv)
    buffer.truncate(10)
    ref.length = 10
    _check_context(buffer, ref, "after the first rollback")
    kv = _kv(1, g)
    buffer.append(*kv)
    ref.append(*kv)
    assert not ref.can_truncate(8)
    before = buffer.context()
    with pytest.raises(ValueError):
        buffer.truncate(8)
    assert buffer.length == 11, "a refused rollback must not change the length"
    torch.testing.assert_close(buffer.context(), before, atol=0, rtol=0)


@pytest.mark.parametrize("window, capacity", [(4, 4), (4, 6), (3, 7), (1, 3)])
def test_random_appends_and_rollbacks_match_the_slot_simulation(window, capacity):
    g = torch.Generator().manual_seed(window * 10 + capacity)
    buffer, ref = make_graded_rolling_kv_cache(B, K, H, window, capacity), RefRing(window, capacity)
    refused = accepted = 0
    for step in range(60):
        op = None
        if ref.length > 0 and torch.rand(1, generator=g).item() < 0.4:
            n = int(torch.randint(max(0, ref.length - capacity - 2), ref.length + 1, (1,), generator=g))
            if ref.can_truncate(n):
                op = partial(buffer.truncate, n)
                ref.length = n
                accepted += 1
            else:
                before = buffer.context()
                with pytest.raises(ValueError):
                    buffer.truncate(n)
                torch.testing.assert_close(buffer.context(), before, atol=0, rtol=0)
                refused += 1
        else:
            kv = _kv(int(torch.randint(1, capacity + 3, (1,), generator=g)), g)
            op = partial(buffer.append, *kv)
            ref.append(*kv)
        _check_context(buffer, ref, f"step {step}", op)
    assert accepted > 3, f"only {accepted} rollbacks were possible: the sequence tests too little"
    assert refused > 0 or window == 1, "no rollback was refused: the sequence tests too little"   # 1: needs no keys


@pytest.mark.parametrize("window, capacity", [(4, 4), (4, 6), (3, 7)])
def test_the_ring_holds_capacity_slots_however_long_the_sequence(window, capacity):
    g = torch.Generator().manual_seed(3)
    buffer = make_graded_rolling_kv_cache(B, K, H, window, capacity)
    want = 2 * B * K * capacity * H * 4
    assert buffer.nbytes == want, f"nbytes {buffer.nbytes}, want 2 B K capacity H x 4 bytes = {want}"
    for T in (1, capacity + 5, 2, 3 * capacity):
        buffer.append(*_kv(T, g))
        assert buffer.nbytes == want, "the ring's memory must not grow with the sequence"


def test_an_append_longer_than_the_ring_writes_each_slot_once():
    g = torch.Generator().manual_seed(4)
    buffer, ref = make_graded_rolling_kv_cache(B, K, H, 3, 5), RefRing(3, 5)
    for T in (2, 12, 1, 9):
        kv = _kv(T, g)
        with watching(DuplicateWrites) as mode:
            buffer.append(*kv)
        ref.append(*kv)
        assert not mode.duplicates, f"appending {T} positions to 5 slots wrote a slot twice in one {mode.duplicates[0]}"
        _check_context(buffer, ref, f"after appending {T}")
