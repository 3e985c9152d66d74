"""A start in seconds: where the fast path keeps what it compiled, and a compiled step that is built while
the model already answers.

- `use_cache_dirs()`: inductor's kernels go to the package's cache folder (`disk_cache.cache_dir()`/inductor,
  beside our C++ kernels and the converted weights), not to torch's default under /tmp, which a reboot
  or a tmp cleaner empties. A folder the user set ($TORCHINDUCTOR_CACHE_DIR) is kept. Called by the
  CLI's fast path before it compiles, never at import: importing the package leaves the environment as
  it was.
- `BackgroundCompile`: a decode step that compiles in a thread of its own, on a cache of its own, while
  the calls made meanwhile run the eager step; the first call after the compiled step is ready runs it.
  The choice is made per call, so a swap happens between two steps, never inside one. The compiled step
  computes what the eager one does (the same model; `chat` and `generate` keep their answers), and a
  compile that fails is announced once and leaves the eager step running. Never started, it is the
  compiled step itself (compiling at the first call, as `torch.compile` does). While it compiles, the
  interpreter switches threads more often (`SWITCH_INTERVAL_S`), so the eager steps are not kept
  waiting for the GIL.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path

from ..progress import mark

INDUCTOR_DIR = "inductor"


def inductor_cache_dir() -> Path:
    """Where inductor keeps its compiled kernels and graphs for the fast path: $TORCHINDUCTOR_CACHE_DIR
    where the user set it (to anything but torch's own default), else the package's cache folder's
    `inductor/`."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and not _torch_default(chosen):
        return Path(chosen)
    from ..model.disk_cache import cache_dir

    return cache_dir() / INDUCTOR_DIR


def _torch_default(folder: str) -> bool:
    """Whether `folder` is torch's default inductor folder (under /tmp), which torch itself writes into the
    environment the first time anything asks inductor where its cache is."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(folder) == os.path.abspath(default_cache_dir())


def use_cache_dirs() -> Path:
    """Point inductor at `inductor_cache_dir()` (torch offers no setting for it but the environment
    variable, which it reads at each compile) and return it. Call before compiling."""
    folder = inductor_cache_dir()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


# What a layout kept on disk depends on, besides the model file: the code that packs it.
_PACKING_CODE = ("quantization/kernels.py", "workshop/kernels/cpu_int4.py", "quantization/linear.py",
                 "quantization/gguf_exact.py", "model/gguf.py")


def _packing_key(device, dtype) -> str:
    import hashlib

    import torch

    from .kernels.cpu_attention import cpu_supports

    root = Path(__file__).parents[1]   # the package
    digest = hashlib.sha256(f"{torch.__version__}|{device}|{dtype}|{cpu_supports()}".encode())
    for name in _PACKING_CODE:
        digest.update((root / name).read_bytes())
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def cached_packed_weights(name: str, device, dtype):
    """Load real model `name` inside this block and its quantized layers take their kernel layouts (the
    int4 repacking for our kernel or torch's, the exact blocks' packing) from the disk cache, memory-mapped,
    where an earlier load with the same file, code, torch, device and dtype left them; a first load packs
    as usual and saves them there (`disk_cache`: atomic writes, checksums; a damaged file is rebuilt)."""
    import torch

    from ..model.disk_cache import cache_entry, read_verified, write_verified
    from ..model.real_models import REAL_MODELS, gguf_path
    from ..quantization.kernels import PackedStore, reuse_packed

    if name not in REAL_MODELS:
        yield None
        return
    path = cache_entry(name, gguf_path(name)) / f"packed-{_packing_key(device, dtype)}.pt"
    entries = read_verified(path, lambda p: torch.load(p, map_location="cpu", mmap=True, weights_only=True))
    with reuse_packed(PackedStore(entries)) as store:
        yield store
    if store.made and store.reused < len(store.made):
        write_verified(path, lambda p: torch.save(store.made, p))


def describe_caches() -> str:
    """One line: where the fast path keeps what it converts and compiles."""
    from ..model.disk_cache import cache_dir

    return (f"caches: {cache_dir()} (converted weights, our C++ kernels); inductor's compiled steps in "
            f"{inductor_cache_dir()}")


# `generate` decodes an answer of fewer new tokens than this eagerly, without compiling: even from the
# cache, tracing the model again takes longer than such an answer takes eagerly.
SHORT_ANSWER_TOKENS = 64
_running: set = set()   # BackgroundCompile threads still compiling
# Python's switch interval while a background compile runs. Compiling is mostly Python holding the GIL;
# each torch op of the eager step in the other thread gives the GIL up and must then wait for it, by
# default up to 5 ms each time: a prefill of a few hundred ops would wait seconds for its turns. With
# a short interval the compiling thread hands the GIL over within a tenth of a millisecond.
SWITCH_INTERVAL_S = 1e-4
_default_switch: list = []
_switch_lock = threading.Lock()


def exit_code(code: int | None) -> int | None:
    """`code`, for the command line's `SystemExit`; but while a background compile still runs, the process
    ends here, at once, with `code` (`os._exit`, after flushing stdout and stderr): the compile's thread is
    inside torch's C++, and tearing the interpreter down around it can abort the process. Its finished
    parts are already in inductor's cache (written atomically), so the next start reuses them."""
    if any(thread.is_alive() for thread in list(_running)):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:   # noqa: BLE001 - a closed stream: nothing left to flush
                pass
        os._exit(code if isinstance(code, int) else 0 if code is None else 1)
    return code


class BackgroundCompile:
    """`step(*args)`: `eager(*args)` until `compiled` is ready, then `compiled(*args)`.

    `start()` begins: `prepare()` runs at once, in the caller's thread (what must not run beside
    the caller's own work, such as an eager prefill through the model's hooks), and returns `warm_up`,
    which a daemon thread then runs: it calls `compiled` on state of its own, so that torch compiles it.
    Once `warm_up` returns, `ready` is set and the next call runs `compiled`. If `warm_up` raises, the
    failure is said once on `stream` (stderr) and every call keeps running `eager`. Before `start`, a
    call runs `compiled` (which compiles at its first call, in the caller)."""

    def __init__(self, compiled, eager, prepare, what: str = "the decode step", stream=None):
        for name, fn in (("compiled", compiled), ("eager", eager), ("prepare", prepare)):
            if not callable(fn):
                raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
        self.compiled, self.eager, self.prepare, self.what, self.stream = compiled, eager, prepare, what, stream
        self.ready = False
        self.error: BaseException | None = None
        self.seconds: float | None = None    # how long the background compile took
        self.eager_calls = self.compiled_calls = 0
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> BackgroundCompile:
        """Run `prepare()` here and the `warm_up` it returns in a background thread (once: a second call
        does nothing). Returns self."""
        with self._lock:
            if self._thread is not None:
                return self
            warm_up = self.prepare()
            if not callable(warm_up):
                raise TypeError(f"prepare() must return the warm-up function, got {type(warm_up).__name__}")
            self._thread = threading.Thread(target=self._compile, args=(warm_up,), name="background compile",
                                            daemon=True)
            with _switch_lock:
                if not _running:
                    _default_switch[:] = [sys.getswitchinterval()]
                    sys.setswitchinterval(SWITCH_INTERVAL_S)
                _running.add(self._thread)
            self._thread.start()
        return self

    def _compile(self, warm_up) -> None:
        t0 = time.perf_counter()
        try:
            warm_up()
        except Exception as error:   # noqa: BLE001 - any failure: the eager step carries on, said once
            self.error = error
            text = str(error).strip().splitlines()
            print(f"\n[compiling {self.what} failed ({type(error).__name__}: {text[-1][:200] if text else ''}); "
                  f"decoding eagerly]", file=self.stream or sys.stderr, flush=True)
        else:
            self.ready = True
            mark("compiled")
        finally:
            self.seconds = time.perf_counter() - t0
            self._done.set()
            with _switch_lock:
                _running.discard(threading.current_thread())
                if not _running and _default_switch:
                    sys.setswitchinterval(_default_switch.pop())

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background compile to end (ready or failed); whether it ended. False if never started."""
        return self._thread is not None and self._done.wait(timeout)

    def __call__(self, *args, **kwargs):
        if self._thread is None or self.ready:
            self.compiled_calls += 1
            return self.compiled(*args, **kwargs)
        self.eager_calls += 1
        return self.eager(*args, **kwargs)


__all__ = ["INDUCTOR_DIR", "SHORT_ANSWER_TOKENS", "BackgroundCompile", "describe_caches", "exit_code",
           "inductor_cache_dir", "use_cache_dirs"]
