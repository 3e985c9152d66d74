"""The weights a decode step streams, moved into one block of memory backed by 2 MB pages.

A batch-1 decode step reads every weight once: SmolLM2-135M in bf16 is 269 MB, about 66,000 pages of
4 KB. The CPU's address-translation cache (the TLB) holds a few thousand pages, so each step walks the
page tables for every one of them, and it evicts the translations (and, with the weights themselves,
the cached page tables) of everything else the step touches: the Python and dynamo code before the
compiled graph, the graph's wrapper, the KV cache. Every step then starts cold. On 2 MB pages the same
weights are ~135 pages. Linux hands out such pages ("transparent huge pages") where a program asks
for them with `madvise(MADV_HUGEPAGE)`; torch's allocator asks only when `THP_MEM_ALLOC_ENABLE` is set
before torch loads, and then only for allocations of 2 MB or more, which leaves out most of a small
model's matrices. So `place_on_huge_pages` allocates one block for all of them, one after the other
in the order the step reads them, and makes each tensor a view of its own slice of that block.

It changes no number: each tensor keeps its values, shape, dtype and Parameter object (tied weights
stay tied), and each has a storage of its own size, so saving one tensor writes its bytes only. A
quantized layer's kernel layout (derived data, not in the state dict) moves instead of its codes.
`cpu_tuning.tune_for_cpu` applies it; `bench generation` and `bench llamacpp` run with it.
"""

from __future__ import annotations

import dataclasses
import mmap
import sys
import weakref
from pathlib import Path

import torch
import torch.nn as nn

PAGE = 2 << 20          # a huge page on x86-64
ALIGN = 64              # each tensor starts on a cache line
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_blocks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> its block (an mmap)


def unavailable() -> str | None:
    """None where this process can ask the kernel for 2 MB pages, else why not."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return f"transparent huge pages are a Linux feature (this is {sys.platform})"
    try:
        setting = _THP.read_text()
    except OSError:
        return f"this kernel has no transparent huge pages ({_THP} cannot be read)"
    if "[never]" in setting:
        return f"transparent huge pages are off ({_THP}: {setting.strip()})"
    return None


def _owned_tensors(model: nn.Module):
    """(module, name, tensor, streamed) for every parameter, buffer and quantized kernel layout tensor of
    `model` (a layout's as name "_packed.<field>"); streamed: whether a decode step reads it in full.
    Not streamed: tables a step reads a row of (token embeddings: a table tied to the output head is
    read through the head; RoPE's angles) and a quantized layer's codes when a kernel layout (derived
    data, not in the state dict) is what its kernel reads."""
    from ..model.layers import RotaryEmbedding

    for module in model.modules():
        packed = getattr(module, "_packed", None)
        packed = packed if dataclasses.is_dataclass(packed) else None
        for f in dataclasses.fields(packed) if packed is not None else ():
            if isinstance(getattr(packed, f.name), torch.Tensor):
                yield module, f"_packed.{f.name}", getattr(packed, f.name), True
        # (`quantization` sits above this module: its embedding is known by name, as in `accounting`)
        lookup = isinstance(module, (nn.Embedding, RotaryEmbedding)) or type(module).__name__ == "QuantizedEmbedding"
        streamed = packed is None and not lookup
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            yield module, name, t, streamed


def _movable_groups(model: nn.Module) -> list[list[tuple[nn.Module, str, torch.Tensor]]]:
    """The streamed tensors as groups that share one storage (a tied weight: one group of two names), in
    module order. A group moves whole or not at all, so what aliases stays aliased: it is left out if
    any of its tensors is a view of part of a larger storage (a slice of a fused weight) or differs
    from the others in shape or dtype."""
    groups, streamed = {}, {}   # streamed: storage -> when a step first reads it (a tied table: at the head)
    for module, name, t, reads in _owned_tensors(model):
        if t is None or t.device.type != "cpu" or t.numel() == 0:
            continue
        key = t.untyped_storage().data_ptr()
        groups.setdefault(key, []).append((module, name, t))
        if reads:
            streamed.setdefault(key, len(streamed))

    def whole(t, first):
        return (t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
                and t.shape == first.shape and t.dtype == first.dtype)
    return [groups[key] for key in sorted(streamed, key=streamed.get)
            if all(whole(t, groups[key][0][2]) for _, _, t in groups[key])]


def streamed_tensors(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(owner, name, tensor) for every tensor a decode step reads in full that can move (one per
    storage; see `_movable_groups`), in module order: what `place_on_huge_pages` moves."""
    return [group[0] for group in _movable_groups(model)]


def _inside(block: mmap.mmap, tensors) -> bool:
    start = torch.frombuffer(block, dtype=torch.uint8, count=1).data_ptr()
    return all(start <= t.data_ptr() and t.data_ptr() + t.nbytes <= start + len(block) for _, _, t in tensors)


def place_on_huge_pages(model: nn.Module) -> int:
    """Move the tensors a decode step streams (`streamed_tensors`) into one block backed by 2 MB pages;
    return the block's bytes (0 when there is nothing to move). Idempotent: a model already placed
    (and not changed since) is left as it is. Raises RuntimeError where `unavailable()` says why not,
    or where the kernel refuses the request."""
    if (reason := unavailable()) is not None:
        raise RuntimeError(reason)
    groups = _movable_groups(model)
    tensors = [group[0] for group in groups]
    if not tensors:
        return 0
    block = _blocks.get(model)
    if block is not None and _inside(block, tensors):
        return len(block)
    block, offset = _new_block(sum(-(-t.nbytes // ALIGN) * ALIGN for _, _, t in tensors))
    with torch.no_grad():
        for group in groups:
            t = group[0][2]
            # a storage of its own size (not a view of the whole block): saving one tensor saves its bytes
            view = torch.frombuffer(block, dtype=t.dtype, count=t.numel(), offset=offset).view(t.shape)
            view.copy_(t)
            for owner, name, _ in group:
                _replace(owner, name, view)
            offset += -(-t.nbytes // ALIGN) * ALIGN
    _blocks[model] = block
    return len(block)


def _new_block(nbytes: int) -> tuple[mmap.mmap, int]:
    """A block of whole 2 MB pages holding `nbytes` from the returned offset (its first page boundary)."""
    size = -(-nbytes // PAGE) * PAGE + PAGE   # whole pages, and room to start on a page boundary
    # + a 4 KB tail without 2 MB pages: the kernel would otherwise merge two such blocks that end up
    # side by side into one mapping, and /proc/self/smaps (`huge_page_bytes`) could not tell them apart
    block = mmap.mmap(-1, size + mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        _ask_for_huge_pages(block, size)   # before the first write: the pages are 2 MB from the start
    except OSError as e:
        block.close()
        raise RuntimeError(f"the kernel refused 2 MB pages (madvise: {e})") from e
    return block, -torch.frombuffer(block, dtype=torch.uint8, count=1).data_ptr() % PAGE


def _ask_for_huge_pages(block: mmap.mmap, size: int) -> None:
    block.madvise(mmap.MADV_HUGEPAGE, 0, size)
    block.madvise(mmap.MADV_NOHUGEPAGE, size, len(block) - size)


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor on 2 MB pages of its own where this process can have them (else
    `torch.empty`): what a memory-bandwidth probe reads, so that it streams under the same address
    translation as the weights it is compared with."""
    if unavailable() is not None:
        return torch.empty(numel, dtype=dtype)
    try:
        block, offset = _new_block(numel * dtype.itemsize)
    except RuntimeError:
        return torch.empty(numel, dtype=dtype)
    return torch.frombuffer(block, dtype=dtype, count=numel, offset=offset)


def _replace(owner: nn.Module, name: str, new: torch.Tensor) -> None:
    """Point `owner.<name>` at `new` (same values): a Parameter keeps its identity (so tied weights stay
    tied), a buffer is swapped, a kernel layout is rebuilt (which marks its tensors static again)."""
    if name.startswith("_packed."):
        owner._packed = dataclasses.replace(owner._packed, **{name.split(".", 1)[1]: new})
    elif name in owner._parameters:
        owner._parameters[name].data = new
    else:
        owner._buffers[name] = new


def huge_page_bytes(model: nn.Module) -> int | None:
    """Bytes of `model`'s block that the kernel backs with 2 MB pages now (from /proc/self/smaps; the
    kernel may grant fewer than asked when memory is fragmented); None when the model has no block."""
    block = _blocks.get(model)
    if block is None:
        return None
    start = torch.frombuffer(block, dtype=torch.uint8, count=1).data_ptr()
    total, inside = 0, False
    try:
        for line in Path("/proc/self/smaps").read_text().splitlines():
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):   # a mapping's header: "start-end perms ..."
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = start <= lo and hi <= start + len(block)   # the block's own mapping(s)
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    except OSError:
        return None
    return total
