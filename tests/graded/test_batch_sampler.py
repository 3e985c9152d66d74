"""Graded: the training batch sampler (get_batch). Expected windows are cut here by slicing."""

import torch
from adapters import run_get_batch


def test_windows_are_slices_and_targets_are_shifted_by_one():
    data = torch.arange(1000) * 3 + 7        # every window is identified by its first value
    x, y = run_get_batch(data, 16, 12, torch.Generator().manual_seed(3))
    assert x.shape == y.shape == (16, 12) and x.dtype == torch.int64
    for row_x, row_y in zip(x, y):
        s = int((row_x[0] - 7) // 3)
        assert torch.equal(row_x, data[s:s + 12]) and torch.equal(row_y, data[s + 1:s + 13])
    again, _ = run_get_batch(data, 16, 12, torch.Generator().manual_seed(3))
    assert torch.equal(x, again), "the same generator seed must give the same batch"


def test_the_only_window_of_a_stream_of_seq_len_plus_one_tokens():
    data = torch.arange(9)
    x, y = run_get_batch(data, 4, 8, torch.Generator().manual_seed(0))
    assert torch.equal(x, data[:8].expand(4, 8)) and torch.equal(y, data[1:].expand(4, 8))


def test_every_valid_start_is_drawn_uniformly():
    # 5 valid starts (numel - seq_len): 2000 windows; each start's count within a generous 4.5 sigma band
    data = torch.arange(13)
    x, _ = run_get_batch(data, 2000, 8, torch.Generator().manual_seed(1))
    counts = torch.bincount(x[:, 0], minlength=5)
    assert counts.numel() == 5, f"starts beyond the last valid one were drawn: {counts.tolist()}"
    sigma = (2000 * 0.2 * 0.8) ** 0.5
    assert all(abs(int(c) - 400) < 4.5 * sigma for c in counts), f"start counts {counts.tolist()}"

