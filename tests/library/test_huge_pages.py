"""The streamed weights on 2 MB pages (`huge_pages`, applied by `tune_for_cpu`): every tensor a decode
step reads moves into one block, and nothing the model computes or saves changes."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import adapters
from cs336_inference.workshop import cpu_tuning
from cs336_inference.workshop import huge_pages as hp
from cs336_inference.quantization import quantize_model

why_not = hp.unavailable()
needs_pages = pytest.mark.skipif(why_not is not None, reason=f"no 2 MB pages here: {why_not}")


def _model(dtype=torch.float32, tie=True):
    config = adapters.make_config(vocab_size=97, context_length=64, d_model=64, num_layers=2, num_heads=4,
                                  num_kv_heads=2, d_ff=160, tie_embeddings=tie)
    return adapters.make_model(config, seed=0).eval().to(dtype)


def _block_range(model) -> tuple[int, int]:
    block = hp._blocks[model]
    start = torch.frombuffer(block, dtype=torch.uint8, count=1).data_ptr()
    return start, start + len(block)


def _logits(model, ids):
    with torch.no_grad():
        return adapters.run_model(model, ids)


@needs_pages
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_placing_moves_every_streamed_weight_into_one_block_and_changes_no_number(dtype):
    model = _model(dtype)
    before = copy.deepcopy(model)
    params = {name: p for name, p in model.named_parameters()}
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(0))

    size = hp.place_on_huge_pages(model)
    start, end = _block_range(model)
    assert size == end - start
    streamed = hp.streamed_tensors(model)
    # every parameter once (the tied embedding table through the head; not RoPE's tables), each in the
    # block, in module order, on a cache line, with a storage of its own size
    assert sorted(id(t) for _, _, t in streamed) == sorted(id(p) for p in model.parameters())
    assert model.lm_head.weight.data_ptr() == max(t.data_ptr() for _, _, t in streamed)   # read last, placed last
    ptrs = [t.data_ptr() for _, _, t in streamed]
    assert ptrs == sorted(ptrs) and ptrs[0] % hp.PAGE == 0 and start <= ptrs[0] < start + hp.PAGE
    for _, _, t in streamed:
        assert start <= t.data_ptr() and t.data_ptr() + t.nbytes <= end and t.data_ptr() % hp.ALIGN == 0
        assert t.untyped_storage().nbytes() == t.nbytes
    # the same Parameter objects (tied weights stay tied), values, state dict and logits
    assert all(p is params[name] for name, p in model.named_parameters())
    assert model.lm_head.weight is model.token_embeddings.weight
    reference = before.state_dict()
    assert all(torch.equal(t, reference[k]) for k, t in model.state_dict().items())
    assert torch.equal(_logits(model, ids), _logits(before, ids))
    hp.place_on_huge_pages(model)                                   # idempotent: nothing moves again
    assert [t.data_ptr() for _, _, t in hp.streamed_tensors(model)] == ptrs
    granted = hp.huge_page_bytes(model)
    assert isinstance(granted, int) and 0 <= granted <= size and hp.huge_page_bytes(before) is None


@needs_pages
def test_what_aliases_stays_aliased():
    """Two Parameters over one storage (a head tied by hand) move together; a view of part of a larger
    tensor (a slice of a fused weight) is left where it is, since moving it alone would split it off."""
    model = _model(tie=False)
    model.lm_head.weight = torch.nn.Parameter(model.token_embeddings.weight.data)   # same storage, two objects
    fused = torch.randn(2 * 160, 64)
    model.layers[0].ffn.w1.weight = torch.nn.Parameter(fused[:160])                 # a view of part of it
    hp.place_on_huge_pages(model)
    start, end = _block_range(model)
    assert model.lm_head.weight.data_ptr() == model.token_embeddings.weight.data_ptr()
    assert start <= model.lm_head.weight.data_ptr() < end
    assert model.layers[0].ffn.w1.weight.data_ptr() == fused.data_ptr()
    assert start <= model.layers[0].ffn.w3.weight.data_ptr() < end


@needs_pages
def test_saving_one_placed_weight_writes_its_own_bytes_not_the_block():
    model = _model(tie=False)
    hp.place_on_huge_pages(model)
    weight = model.layers[0].ffn.w2.weight
    buffer = io.BytesIO()
    torch.save(weight, buffer)
    assert weight.nbytes < len(buffer.getvalue()) < weight.nbytes + 4096 < len(hp._blocks[model])
    assert torch.equal(torch.load(io.BytesIO(buffer.getvalue())), weight)


@needs_pages
def test_a_weight_replaced_after_placing_is_placed_again():
    model = _model(tie=False)
    hp.place_on_huge_pages(model)
    old = _block_range(model)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())   # ordinary memory
    hp.place_on_huge_pages(model)
    start, end = _block_range(model)
    assert (start, end) != old and start <= model.lm_head.weight.data_ptr() < end


@needs_pages
def test_a_quantized_layer_moves_its_kernel_layout_not_its_codes():
    """A packed int4 layer streams its kernel's layout: that moves (and stays marked static for the
    compiler); its codes and scales, what the state dict holds, stay where they were."""
    model = quantize_model(_model(), "rtn", bits=4, group_size=32)
    layers = [m for m in model.modules() if getattr(m, "_packed", None) is not None]
    if not layers:
        pytest.skip("no packed int4 layout on this machine")
    before = copy.deepcopy(model)
    codes = {id(m): m.qweight.data_ptr() for m in layers}
    ids = torch.randint(0, 97, (1, 1), generator=torch.Generator().manual_seed(1))
    hp.place_on_huge_pages(model)
    start, end = _block_range(model)
    for m in layers:
        assert start <= m._packed.weight.data_ptr() < end and m.qweight.data_ptr() == codes[id(m)]
        assert m._packed.weight._dynamo_static_indices == set(range(m._packed.weight.dim()))   # mark_static
    assert torch.equal(_logits(model, ids), _logits(before, ids))


def test_tune_for_cpu_places_the_weights_or_says_why_not(monkeypatch, tmp_path):
    off = tmp_path / "enabled"
    off.write_text("always madvise [never]\n")
    monkeypatch.setattr(hp, "_THP", off)
    model = _model()
    ptrs = [p.data_ptr() for p in model.parameters()]
    tuned = cpu_tuning.tune_for_cpu(model, split=False, threads=False)
    assert [p.data_ptr() for p in tuned.parameters()] == ptrs and hp.huge_page_bytes(tuned) is None
    assert "weights on ordinary 4 KB pages (transparent huge pages are off" in cpu_tuning.describe(tuned)
    with pytest.raises(RuntimeError, match="transparent huge pages are off"):
        hp.place_on_huge_pages(model)
    with pytest.raises(TypeError, match="huge_pages must be True or False, got str 'no'"):
        cpu_tuning.tune_for_cpu(model, huge_pages="no")
    monkeypatch.undo()

    def refuse(block, size):
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(hp, "_ask_for_huge_pages", refuse)
    if why_not is None:   # the kernel says no at madvise: nothing moves, and describe says so
        refused = cpu_tuning.tune_for_cpu(_model(), split=False, threads=False)
        assert hp.huge_page_bytes(refused) is None
        assert "4 KB pages (the kernel refused 2 MB pages (madvise: [Errno 22] Invalid argument))" in \
            cpu_tuning.describe(refused)
    monkeypatch.undo()
    if why_not is None:
        tuned = cpu_tuning.tune_for_cpu(_model(), split=False, threads=False)
        assert "streamed weights in one block" in cpu_tuning.describe(tuned)
        kept = cpu_tuning.tune_for_cpu(_model(), split=False, threads=False, huge_pages=False)
        assert hp.huge_page_bytes(kept) is None and "4 KB pages" not in cpu_tuning.describe(kept)


def test_the_bandwidth_probe_reads_a_buffer_on_2mb_pages_where_the_weights_are(monkeypatch, tmp_path):
    """The bandwidth a step is compared with is measured under the same address translation as the
    weights: on 2 MB pages where they are (a buffer of its own, page-aligned), else ordinary memory. The
    core's probe allocates with torch unless given an allocator: the benchmarks pass `huge_pages.empty`."""
    from cs336_inference.accounting.roofline import bandwidth_probe

    x = hp.empty(3 * 2**20 + 5, torch.float32).fill_(2.0)
    assert x.shape == (3 * 2**20 + 5,) and x.dtype == torch.float32 and float(x.sum()) == 2.0 * x.numel()
    probe = bandwidth_probe(nbytes=2**22, repeats=1, empty=hp.empty)
    buffer = next(c.cell_contents for c in probe.__closure__ if isinstance(c.cell_contents, torch.Tensor))
    assert probe() > 0 and float(buffer.sum()) == buffer.numel()
    if why_not is None:
        assert x.data_ptr() % hp.PAGE == 0 and buffer.data_ptr() % hp.PAGE == 0
    off = tmp_path / "enabled"
    off.write_text("always madvise [never]\n")
    monkeypatch.setattr(hp, "_THP", off)
    y = hp.empty(1000, torch.bfloat16)
    assert y.shape == (1000,) and y.dtype == torch.bfloat16 and y.untyped_storage().nbytes() == 2000
