"""The on-disk cache of converted real-model files: written atomically, each with a checksum beside it,
verified before use.

Layout: $CS336_CACHE_DIR, else $XDG_CACHE_HOME/cs336_inference, else ~/.cache/cs336_inference, then one
folder per (model, SHA-256 of its source file, conversion version) holding files such as
`weights-float32.pt` and `config.json`. Each file `F` has a sidecar `F.crc32` ({"size", "crc32"}) written
after it. A read checks the size, then streams the file through CRC-32 (about a second per half
gigabyte, and the read warms the page cache for the memory map that follows): a missing, empty,
truncated or hand-edited file, or one whose sidecar is missing, is announced by name and rebuilt from
the source. A crash while writing never leaves a half-written file (write, then rename); an
unwritable cache directory only costs the conversion time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import warnings
import zlib
from pathlib import Path
from typing import Callable, TypeVar

CACHE_VERSION = 2  # bump when the conversion changes, so stale caches are not reused
T = TypeVar("T")


def cache_dir() -> Path:
    """$CS336_CACHE_DIR, else $XDG_CACHE_HOME/cs336_inference, else ~/.cache/cs336_inference."""
    if os.environ.get("CS336_CACHE_DIR"):
        return Path(os.environ["CS336_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cs336_inference"


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_entry(name: str, source: Path) -> Path:
    """The cache folder of this exact source file (its content hash) and conversion version."""
    st = source.stat()
    return cache_dir() / f"{name}-{_sha256(str(source), st.st_size, st.st_mtime_ns)[:16]}-v{CACHE_VERSION}"


def _checksum(path: Path) -> dict:
    crc, size = 0, 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return {"size": size, "crc32": crc}


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".crc32")


def _write_atomic(path: Path, write: Callable[[str], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_verified(path: Path, write: Callable[[str], None]) -> None:
    """write(tmp_path), rename it to `path`, then record its checksum beside it. An OSError (read-only or
    full disk) is a warning: the caller already holds what it wanted to cache."""
    try:
        _write_atomic(path, write)
        record = json.dumps(_checksum(path))
        _write_atomic(_sidecar(path), lambda p: Path(p).write_text(record))
    except OSError as e:
        warnings.warn(f"could not cache {path} ({e}); the next load converts again", stacklevel=3)


def read_verified(path: Path, load: Callable[[Path], T]) -> T | None:
    """load(path) when `path` matches the checksum written with it; None when absent (first use) or,
    with a warning naming the file, when it is damaged or edited: the caller then rebuilds it."""
    if not path.exists() and not _sidecar(path).exists():
        return None
    try:
        expected = json.loads(_sidecar(path).read_text())
        found = _checksum(path)
        if found != expected:
            raise ValueError(f"{found['size']} bytes with CRC-32 {found['crc32']:08x}, but "
                             f"{expected.get('size')} bytes with {expected.get('crc32', 0):08x} were written")
        return load(path)
    except Exception as e:  # missing sidecar or file, checksum mismatch, or a file its loader refuses
        warnings.warn(f"ignoring the damaged cache file {path} ({type(e).__name__}: {e}); converting it again",
                      stacklevel=3)
        return None
