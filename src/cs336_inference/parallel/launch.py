"""Start p worker processes on this machine, one per rank, and run a function on each (as torchrun does).

`launch(fn, world_size, *args)` spawns the ranks with `torch.multiprocessing` (a fresh interpreter
each: fork is unsafe once torch has started its thread pools), points them at a free port on
127.0.0.1 through the `env://` variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK),
joins the process group in each, runs `fn(*args)` and returns rank 0's result.

A rank that raises or dies (killed, out of memory) must not leave the others blocked in a collective
that will never complete: the parent watches every process, and at the first failure it kills the
rest and raises `RankFailedError` naming the rank (its traceback, or how it died).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

POLL_S = 0.05           # how often the parent looks at its children
GRACE_S = 3.0           # after a terminate, how long a child has before it is killed


class RankFailedError(RuntimeError):
    """A rank raised or died; `rank` says which (the others were stopped)."""

    def __init__(self, rank: int, why: str):
        super().__init__(f"tensor-parallel rank {rank} failed: {why}")
        self.rank = rank


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, threads: int | None, fn, args, kwargs,
            results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    if threads:
        torch.set_num_threads(threads)   # p ranks share the cores
    import torch.distributed as dist
    try:
        dist.init_process_group(backend, init_method="env://")
        value = fn(*args, **kwargs)
        # plain pickle bytes: torch's queue would share tensors through file descriptors that vanish
        # with this process once it exits
        results.put((rank, "ok", pickle.dumps(value) if rank == 0 else None))
    except BaseException:   # reported to the parent, which stops every rank
        results.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _how_it_ended(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _first_failure(processes, done, rank: int, error: str) -> RankFailedError:
    """Rank `rank` reported `error`; but when another rank died without a word (killed), the survivors'
    collectives fail too ("connection reset"), so blame the rank that died."""
    time.sleep(2 * POLL_S)
    for other, p in enumerate(processes):
        if other != rank and other not in done and p.exitcode is not None and p.exitcode < 0:
            return RankFailedError(other, f"{_how_it_ended(p.exitcode)} (rank {rank} then failed: "
                                          f"{error.strip().splitlines()[-1]})")
    return RankFailedError(rank, "\n" + error)


def _stop(processes) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


@contextlib.contextmanager
def _main_script_hidden(fn):
    """While the ranks start: a `fn` that lives in a module (not in the script being run) needs nothing from
    that script, so spawn is not told its path; otherwise every rank would re-run the script's top level
    (a notebook exported to .py, run with python, would launch ranks from each of its ranks)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if fn.__module__ == "__main__" or path is None or getattr(main, "__spec__", None) is not None:
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def launch(fn, world_size: int, *args, backend: str = "gloo", threads_per_rank: int | None = None,
           timeout_s: float | None = None, **kwargs):
    """Run `fn(*args, **kwargs)` on `world_size` ranks (each in its own process, the process group joined)
    and return rank 0's result. fn must be importable by name (a module-level function) and its result
    picklable. threads_per_rank: torch threads per rank (default: the cores divided among the ranks).
    Raises `RankFailedError` naming the first rank that raised or died, after stopping all the others;
    TimeoutError after timeout_s (if given)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if threads_per_rank is None and backend == "gloo":
        threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    processes = [ctx.Process(target=_worker, daemon=True, name=f"tp-rank-{rank}",
                             args=(rank, world_size, port, backend, threads_per_rank, fn, args, kwargs, results))
                 for rank in range(world_size)]
    with _main_script_hidden(fn):
        for p in processes:
            p.start()
    done: dict[int, object] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while len(done) < world_size:
            try:
                rank, status, value = results.get(timeout=POLL_S)
            except queue.Empty:
                for rank, p in enumerate(processes):
                    if rank not in done and p.exitcode is not None:
                        time.sleep(POLL_S)           # its last message may still be in the pipe
                        if results.empty():
                            raise RankFailedError(rank, _how_it_ended(p.exitcode)) from None
                        break
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel run of {world_size} ranks did not finish in {timeout_s} s; "
                                       f"ranks still running: {sorted(set(range(world_size)) - set(done))}") from None
                continue
            if status == "error":
                raise _first_failure(processes, done, rank, value)
            done[rank] = value
    finally:
        _stop(processes)
    return pickle.loads(done[0])


__all__ = ["RankFailedError", "free_port", "launch"]
