"""One name for each concept across the library, the graded API (the homework registry and the skeleton
written from it) and tests/adapters.py.

- every graded class wraps the library class of the same name (a graded `KVCacheManager` is the
  library's `KVCacheManager`, reduced to what a student writes), so a name never means two things;
- the renamed graded names (registry.FORMER_NAMES) are gone from the graded API; a former name that the
  library still uses (`KVCache`, the model-wide cache) means only that;
- the adapters' deprecated names are the current adapters, and the library helpers are named after
  what they return.
(tests/library/test_grader.py checks one adapter per graded name and the skeleton against the reference,
and grades a package written to the old skeleton.)
"""

from __future__ import annotations

import inspect

import pytest

import adapters
import cs336_inference
from cs336_inference import model as library_model
from cs336_inference import serving as library_serving
from cs336_inference.homework import FORMER_NAMES, GRADED, graded_names, skeleton

LIBRARY = (library_serving, library_model, cs336_inference)   # where a public library name lives

# the smallest arguments each graded class takes
CLASS_ARGS = {"ContiguousKVCache": (1, 1, 2, 4), "RollingKVCache": (1, 1, 2, 2, 3), "BlockAllocator": (4, 2),
              "KVCacheManager": (4, 2)}


def _library_object(name: str):
    return next((getattr(ns, name) for ns in LIBRARY if hasattr(ns, name)), None)


def test_every_graded_class_wraps_the_library_class_of_its_name():
    graded_names()   # registers every graded name
    classes = sorted(name for name, entry in GRADED.items() if entry.kind == "class")
    assert classes == sorted(CLASS_ARGS), "a new graded class: add its arguments here"
    for name in classes:
        library_class = _library_object(name)
        assert inspect.isclass(library_class), f"graded class {name} has no library class of that name"
        wrapped = [v for v in vars(GRADED[name].obj(*CLASS_ARGS[name])).values()
                   if type(v).__module__.startswith("cs336_inference.") and "homework" not in type(v).__module__]
        assert any(isinstance(v, library_class) for v in wrapped), \
            f"graded {name} wraps {[type(v).__name__ for v in wrapped]}, not the library's {name}"


def test_former_graded_names_are_gone_and_each_points_to_a_current_one():
    names = set(graded_names())
    for former, current in FORMER_NAMES.items():
        assert former not in names and current in names, (former, current)
    # a former graded name the library keeps names one library concept, not the graded one's
    assert _library_object("KVCache") is library_model.KVCache
    assert not hasattr(library_serving, "BlockManager") and not hasattr(library_model, "RollingKVBuffer")


def test_the_skeleton_defines_only_the_current_names(tmp_path):
    skeleton.write_skeleton(tmp_path / "student")
    text = "\n".join(p.read_text() for p in sorted((tmp_path / "student").glob("*.py")))
    for former, current in FORMER_NAMES.items():
        assert f"class {current}" in text and f"class {former}:" not in text and f"class {former}(" not in text


def test_adapter_names_agree_with_what_they_make():
    assert adapters.make_paged_block_manager is adapters.make_graded_kv_cache_manager
    assert adapters.make_rolling_kv_buffer is adapters.make_graded_rolling_kv_cache
    assert adapters.make_graded_kv_cache is adapters.make_graded_contiguous_kv_cache
    assert not hasattr(adapters, "make_block_manager"), "the library helper is make_kv_cache_manager"
    assert type(adapters.make_kv_cache_manager(4, 2)) is library_serving.KVCacheManager
    assert library_serving.BlockAllocator is library_serving.BlockPool, "the graded allocator is the library's pool"


@pytest.mark.parametrize("former", sorted(FORMER_NAMES))
def test_a_package_that_defines_only_a_former_name_is_still_graded(former, monkeypatch):
    """The adapter asks for the current name, then the former one (the reference here, renamed in place)."""
    import implementation

    reference = implementation.module()
    current = FORMER_NAMES[former]
    monkeypatch.setattr(reference, former, getattr(reference, current), raising=False)
    monkeypatch.delattr(reference, current)
    make = {"ContiguousKVCache": adapters.make_graded_contiguous_kv_cache,
            "RollingKVCache": adapters.make_graded_rolling_kv_cache,
            "KVCacheManager": adapters.make_graded_kv_cache_manager}[current]
    args = CLASS_ARGS[current]
    assert make(*args) is not None
    monkeypatch.delattr(reference, former)
    with pytest.raises(implementation.NotImplementedGraded, match=f"not implemented: {current} "):
        make(*args)
