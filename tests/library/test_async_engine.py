"""The asyncio wrapper: streams, merging, aborts, refusals, shutdown (on a scripted fake engine), and
the same greedy tokens as `generate` on the real engine and toy model."""

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field

import pytest

from cs336_inference.serving.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError


@dataclass
class Out:
    request_id: str
    new_token_ids: list
    finished: bool
    finish_reason: str | None = None
    index: int = 0
    error: str | None = None


@dataclass
class Params:
    max_tokens: int = 4
    n: int = 1


@dataclass
class FakeEngine:
    """Each request emits prompt[-1] + 1, + 2, ... one token per step per sample; one 'block' each."""

    step_seconds: float = 0.0
    fail_at_step: int | None = None
    live: dict = field(default_factory=dict)
    steps: int = 0
    thread_ids: set = field(default_factory=set)

    def add_request(self, prompt_token_ids, sampling_params, request_id=None, arrival_time=None):
        self.thread_ids.add(threading.get_ident())
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        self.live[request_id] = [prompt_token_ids[-1], sampling_params, [0] * sampling_params.n]
        return request_id

    def abort(self, request_id):
        return self.live.pop(request_id, None) is not None

    def has_unfinished(self):
        return bool(self.live)

    def step(self):
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        if self.fail_at_step == self.steps:
            raise RuntimeError("boom")
        time.sleep(self.step_seconds)
        outs = []
        for rid, (last, params, done) in list(self.live.items()):
            for k in range(params.n):
                if done[k] < params.max_tokens:
                    done[k] += 1
                    finished = done[k] == params.max_tokens
                    outs.append(Out(rid, [last + done[k] + 100 * k], finished, "length" if finished else None, k))
            if all(d == params.max_tokens for d in done):
                del self.live[rid]
        return outs

    def stats(self):
        return {"running": len(self.live), "waiting": 0, "kv_blocks_used": len(self.live), "kv_blocks_total": 64}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


async def collect(served, prompt, params, request_id=None):
    tokens = {}
    async for out in served.generate(prompt, params, request_id):
        tokens.setdefault(out.index, []).extend(out.new_token_ids)
    return tokens


def test_concurrent_streams_get_every_token_in_order_from_one_engine_thread():
    engine = FakeEngine()

    async def main():
        async with AsyncEngine(engine) as served:
            results = await asyncio.gather(*(collect(served, [10 * i], Params(max_tokens=5)) for i in range(20)),
                                           collect(served, [7], Params(max_tokens=3, n=2)))
            return results

    results = run(main())
    for i, tokens in enumerate(results[:20]):
        assert tokens == {0: [10 * i + k for k in range(1, 6)]}
    assert results[20] == {0: [8, 9, 10], 1: [108, 109, 110]}
    assert len(engine.thread_ids) == 1 and threading.get_ident() not in engine.thread_ids


def test_a_slow_consumer_gets_merged_deltas_and_stalls_no_one():
    engine = FakeEngine()

    async def main():
        async with AsyncEngine(engine) as served:
            slow = served.generate([0], Params(max_tokens=50))
            first = await slow.__anext__()
            fast = await collect(served, [1000], Params(max_tokens=50))   # runs to the end meanwhile
            rest = [first] + [out async for out in slow]
            return fast, rest

    fast, rest = run(main())
    assert fast == {0: list(range(1001, 1051))}
    assert [t for out in rest for t in out.new_token_ids] == list(range(1, 51))
    assert len(rest) < 50 and rest[-1].finished      # what piled up came as one merged delta


def test_leaving_a_stream_aborts_its_request_and_idle_costs_no_steps():
    engine = FakeEngine(step_seconds=0.002)

    async def main():
        async with AsyncEngine(engine) as served:
            async with contextlib.aclosing(served.generate([0], Params(max_tokens=10_000), "long")) as stream:
                async for out in stream:
                    if out.new_token_ids[-1] >= 3:
                        break
            for _ in range(200):                       # the abort reaches the engine thread
                if served.stats()["kv_blocks_used"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert not engine.live and served.stats()["kv_blocks_used"] == 0
            steps = engine.steps
            await asyncio.sleep(0.2)
            assert engine.steps == steps               # idle: the thread sleeps, it does not step or poll
            task = asyncio.ensure_future(collect(served, [0], Params(max_tokens=10_000), "cancelled"))
            await asyncio.sleep(0.05)
            task.cancel()                              # a cancelled consumer task aborts too
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                if not engine.live:
                    break
                await asyncio.sleep(0.01)
            assert not engine.live

    run(main())


def test_refusals_overload_and_a_dead_engine_are_reported_to_the_caller():
    async def main():
        async with AsyncEngine(FakeEngine(), max_requests=2) as served:
            with pytest.raises(ValueError, match="empty"):
                await collect(served, [], Params())
            assert await collect(served, [1], Params(max_tokens=1)) == {0: [2]}   # the next one is served
            a = served.generate([1], Params(max_tokens=1000))
            b = served.generate([1], Params(max_tokens=1000))
            await a.__anext__()
            await b.__anext__()
            with pytest.raises(EngineOverloadedError, match="max_requests"):
                await served.generate([1], Params()).__anext__()
            await a.aclose()
            await b.aclose()
        async with AsyncEngine(FakeEngine(fail_at_step=3)) as served:
            with pytest.raises(EngineDeadError, match="boom"):
                await collect(served, [1], Params(max_tokens=10))
            assert not served.is_running
            with pytest.raises(EngineDeadError):
                await served.generate([1], Params()).__anext__()

    run(main())


def test_a_closed_request_id_may_be_reused_and_gets_only_its_own_tokens():
    """Outputs are routed by an id of the AsyncEngine's own: the tokens the engine made for an earlier
    stream "r" (closed, its abort not yet applied) never reach a new stream "r"; an open "r" is refused."""
    engine = FakeEngine(step_seconds=0.002)

    async def main():
        async with AsyncEngine(engine) as served:
            first = served.generate([31], Params(max_tokens=10_000), "r")
            await first.__anext__()
            await asyncio.sleep(0.03)                      # the engine makes more tokens for the first "r"
            with pytest.raises(ValueError, match="'r' is already in flight"):
                await served.generate([0], Params(), "r").__anext__()
            await first.aclose()                           # the abort is on its way to the engine thread
            second = [out async for out in served.generate([33, 31, 33, 94], Params(max_tokens=4), "r")]
            return second

    second = run(main())
    assert [t for out in second for t in out.new_token_ids] == [95, 96, 97, 98]   # prompt[-1] + 1, + 2, ...
    assert {out.request_id for out in second} == {"r"} and second[-1].finished


def test_shutdown_aborts_what_is_in_flight_and_stops_the_thread():
    engine = FakeEngine(step_seconds=0.001)

    async def main():
        served = AsyncEngine(engine)
        stream = served.generate([0], Params(max_tokens=10_000))
        await stream.__anext__()
        await served.shutdown()
        assert not served._thread.is_alive() and not engine.live
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    run(main())


def test_the_async_api_gives_generate_s_greedy_tokens_on_the_real_engine(one_thread):
    from cs336_inference.generation.generate import generate
    from cs336_inference.model import load_pretrained
    from cs336_inference.serving import Engine, SamplingParams

    model = load_pretrained("target").eval()
    prompts = [[84, 104, 101, 32, 99, 97, 116], [65, 32, 100, 111, 103], [79, 110, 99, 101, 32, 117, 112, 111, 110]]
    expected = [generate(model, [p], 20).tokens[0] for p in prompts]

    async def main():
        async with AsyncEngine(Engine(model, clock=time.monotonic, max_num_seqs=4)) as served:
            results = await asyncio.gather(*(collect(served, p, SamplingParams(max_tokens=20)) for p in prompts))
            # a stream "r" closed after its first token, then a new "r" at once: only its own tokens
            first = served.generate(prompts[0], SamplingParams(max_tokens=200), request_id="r")
            await first.__anext__()
            time.sleep(0.2)           # the loop is busy while the engine makes more tokens for the first "r"
            await first.aclose()      # (their deliveries wait in the loop's queue)
            reused = await collect(served, prompts[1], SamplingParams(max_tokens=4), request_id="r")
            return results, reused

    results, reused = run(main())
    assert [r[0] for r in results] == expected
    assert reused == {0: expected[1][:4]}
