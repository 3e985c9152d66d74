"""`Engine`: an online serving engine over a `TransformerLM`, a scheduler and a paged KV cache.

The API (vLLM's `LLMEngine`, reduced):

    request_id = engine.add_request(prompt_token_ids, sampling_params)   # validated here, once
    outputs = engine.step()            # one iteration; the RequestOutput deltas it produced
    engine.abort(request_id)           # frees its blocks now
    engine.has_unfinished(), engine.stats()

One step is schedule -> run -> postprocess (nano-vllm's loop): the scheduler picks the batch
(decodes, prefill chunks, admissions, preemptions), the model runner applies copy-on-write copies
and runs every scheduled token in one forward (selective batching), the sampler draws the tokens
(one device -> host copy per step), and the scheduler's postprocess records them, forks the
samples of a fresh n > 1 request and retires finished sequences. `run(trace)` replays a trace
through the same API; `chat` sessions and the HTTP server are other users of it.

A request that can never run (its worst case does not fit the KV pool, or n > max_num_seqs) is
refused alone: its output has finish_reason "error" and a message naming the limit, and every other
request is served. The engine is single-threaded: call it from one thread (the asyncio wrapper
runs every call on its own one).

The clock: by default a simulated one that starts at 0 and advances by the measured wall time of
each step (scheduling, forward and sampling included); when nothing can run it jumps to the next
arrival instead of sleeping, so every latency is real compute time and a trace with idle gaps
replays without waiting through them. `Engine(model, step_time=cost)` keeps that simulated clock
but advances it by `cost(batch)` seconds per step instead of the measured time: a fixed cost model,
so a replay's every number is identical run to run (the lecture's demos). `Engine(model,
clock=time.monotonic)` uses a real clock instead (an online server: arrivals and idle time are real).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, Hashable

import torch

from .. import _checks
from ..generation.sampling_params import SamplingParams
from ..model.transformer import TransformerLM
from .contiguous_manager import ContiguousManager
from .engine_records import EngineConfig, EngineResult, StepRecord, records_from_outputs
from .kv_cache_manager import KVCacheManager
from .model_runner import ModelRunner
from .request import Request, RequestOutput
from .sampler import sample
from .scheduler import SCHEDULERS, ScheduledBatch
from .sequence import Sequence, SequenceStatus
from .speculative import Proposer, SpeculativeScheduler, hand_features, make_proposer, speculative_sample


class Engine:
    """Serve requests with `model`. `Engine(model, scheduler="static")` overrides EngineConfig fields;
    `decode` runs the steps that only decode (see `ModelRunner`; `serve` passes a compiled one);
    `draft_model` is what `speculative` drafts with (a TransformerLM, MedusaHeads or an EagleDraft)."""

    def __init__(self, model: TransformerLM, config: EngineConfig | None = None,
                 clock: Callable[[], float] | None = None,
                 step_time: Callable[[ScheduledBatch], float] | None = None, decode: Callable | None = None,
                 draft_model: torch.nn.Module | None = None, proposer: Proposer | None = None, **overrides):
        _checks.instance("model", model, TransformerLM, "a TransformerLM (e.g. load_pretrained('target'))")
        if config is not None:
            _checks.instance("config", config, EngineConfig)
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(EngineConfig)})
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; EngineConfig has "
                            f"{[f.name for f in dataclasses.fields(EngineConfig)]}")
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be None or a callable returning seconds, got {clock!r}")
        if step_time is not None and not callable(step_time):
            raise TypeError(f"step_time must be None or a callable batch -> seconds, got {step_time!r}")
        if step_time is not None and clock is not None:
            raise ValueError("step_time sets the cost of a step on the simulated clock; it cannot be combined "
                             "with a real clock (pass one of clock, step_time)")
        self.model = model
        self.config = c = dataclasses.replace(config or EngineConfig(), **overrides)
        self.proposer = _speculative_proposer(model, c, draft_model, proposer)
        num_blocks = ModelRunner.num_blocks_for(model, c.block_size, num_blocks=c.num_blocks,
                                                kv_budget_bytes=c.kv_budget_bytes,
                                                default_tokens=c.max_num_seqs * min(model.config.context_length, 2048))
        if c.kv_layout == "contiguous":  # the same token slots, one slot per "block"
            self.runner = self.make_runner(model, num_blocks * c.block_size, 1, decode)
        else:
            self.runner = self.make_runner(model, num_blocks, c.block_size, decode)
        self._features = self.proposer is not None and bool(self.proposer.needs_features)
        self.runner.capture_features = self._features
        self._clock = clock
        self._step_time = step_time
        self._request_ids = itertools.count()
        self._reset()

    def make_runner(self, model: TransformerLM, num_blocks: int, block_size: int, decode) -> ModelRunner:
        """The model runner (a hook: the tensor-parallel engine's runner also sends each step to its ranks)."""
        return ModelRunner(model, num_blocks, block_size, decode=decode)

    def _reset(self) -> None:
        """Empty KV memory and queues; the simulated clock back at 0."""
        c = self.config
        if c.kv_layout == "contiguous":
            self.manager = ContiguousManager(self.num_blocks)
        else:
            self.manager = KVCacheManager(self.num_blocks, c.block_size, prefix_caching=c.prefix_caching)
        if self.proposer is None:
            self.scheduler = SCHEDULERS[c.scheduler](self.manager, c.max_num_seqs, c.max_num_batched_tokens,
                                                     c.watermark_blocks, c.chunked_prefill)
        else:
            self.scheduler = SpeculativeScheduler(self.manager, c.max_num_seqs, c.max_num_batched_tokens,
                                                  c.watermark_blocks, c.chunked_prefill, self.proposer,
                                                  c.num_speculative_tokens, c.speculative_disable_by_batch_size)
        self.now = 0.0
        self.last_step: StepRecord | None = None
        self._live: dict[Hashable, _Live] = {}
        self._pending: list[RequestOutput] = []   # refusals and aborts, reported by the next step
        self._seq_ids = itertools.count()

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def _time(self) -> float:
        return self._clock() if self._clock is not None else self.now

    # --- the online API -----------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    request_id: Hashable | None = None, arrival_time: float | None = None) -> Hashable:
        """Queue a request; returns its id (a fresh str when none is given). Bad arguments raise
        ValueError/TypeError here; a request that can never fit is accepted and then refused by the
        next `step` (finish_reason "error")."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        _checks.instance("sampling_params", params, SamplingParams)
        vocab, context = self.model.config.vocab_size, self.model.config.context_length
        prompt = _check_prompt(prompt_token_ids, vocab)
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids must be < vocab_size {vocab}, got {bad_stop}")
        if len(prompt) + params.max_tokens > context:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's context_length ({context})")
        if request_id is None:
            request_id = str(next(self._request_ids))
            while request_id in self._live:
                request_id = str(next(self._request_ids))
        elif request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        request = Request(request_id, prompt, params.max_tokens,
                          self._time() if arrival_time is None else arrival_time, params)
        generators = [None] * params.n
        if params.temperature > 0 and params.seed is not None:
            generators = [torch.Generator(self.model.device).manual_seed(params.seed + k) for k in range(params.n)]
        seq = Sequence(next(self._seq_ids), request, 0, generator=generators[0], pending_forks=generators[1:])
        reason = self.scheduler.never_fits(seq)
        if reason is not None:
            self._pending += [_output(request, k, [], "error", error=f"request {request_id!r} can never run: {reason}")
                              for k in range(params.n)]
            return request_id
        self.scheduler.add(seq)
        self._live[request_id] = _Live(request)
        return request_id

    def abort(self, request_id: Hashable) -> bool:
        """Stop a request now and free its blocks; False (a no-op) if unknown or already finished.
        The next `step` reports it with finish_reason "abort"."""
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        for seq in self.scheduler.abort(request_id):
            self._pending.append(_output(live.request, seq.sample_index, [], "abort", seq=seq, live=live))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> run -> postprocess. Returns this step's RequestOutput deltas:
        one per sample that got a token or finished (refusals and aborts since the last step too)."""
        outputs, self._pending = self._pending, []
        self.last_step = None
        t0, start = time.perf_counter(), self._time()
        batch = self.scheduler.schedule(start)
        if not batch:
            waiting = self.scheduler.waiting
            if waiting and not self.scheduler.running and waiting[0].request.arrival_time <= start:
                raise RuntimeError(f"request {waiting[0].request.request_id!r} cannot be admitted into an "
                                   f"idle engine (a bug: never_fits should have refused it)")
            if waiting and self._clock is None:
                self.now = max(self.now, waiting[0].request.arrival_time)  # idle: jump to the next arrival
            return outputs
        padding = [s.status for s in batch.decodes].count(SequenceStatus.FINISHED)  # before postprocess
        for seq in batch.prefills:
            live = self._live[seq.request.request_id]
            live.first_scheduled_time = start if live.first_scheduled_time is None else live.first_scheduled_time
        try:
            logits = self.runner.execute(batch, self.manager)          # (len(batch.sequences), V)
            sampled = sample(logits, batch) if self.proposer is None else speculative_sample(logits, batch)
            cost = None if self._step_time is None else _step_cost(self._step_time, batch)
        except Exception as e:  # leave the engine consistent: the batch's requests end in an error
            self._fail(batch, f"{type(e).__name__}: {e}")
            raise
        if self._clock is not None:
            end = self._clock()
        else:
            end = start + (time.perf_counter() - t0 if cost is None else cost)
        self.now = max(self.now, end)
        for seq in self.scheduler.postprocess(batch, sampled, end):
            live = self._live[seq.request.request_id]
            new_tokens = seq.token_ids[-seq.num_new_tokens:]   # 1, or a speculative step's accepted run
            outputs.append(_output(seq.request, seq.sample_index, new_tokens, seq.finish_reason,
                                   seq=seq, live=live, time=end))
            if seq.finish_reason is not None:
                live.unfinished -= 1
                if live.unfinished == 0:
                    del self._live[seq.request.request_id]
        if self._features:
            hand_features(self.proposer, batch, sampled, self.runner.features)
        self.last_step = self._record(batch, start, end, padding)
        return outputs

    def warm_up(self) -> None:
        """Serve two short requests, the second joining while the first decodes, then empty the engine
        (queues, KV memory, prefix cache): a compiled `decode` compiles its graphs now, for one sequence
        and for several (torch compiles a batch of one apart), not under the first clients."""
        if self.scheduler.has_unfinished() or self._live:
            raise RuntimeError("warm_up() needs an idle engine: finish or abort the requests added with add_request")
        prompt_len = self.manager.block_size + 2      # past one block: the steps `decode` runs
        params = SamplingParams(max_tokens=6)
        self.add_request([0] * prompt_len, params)
        for _ in range(3):                             # its prefill, then decode steps alone
            self.step()
        self.add_request([1] * prompt_len, params)
        while self.has_unfinished():
            self.step()
        self._reset()

    def stats(self) -> dict:
        """What a /metrics endpoint shows: requests running and waiting, KV blocks used and total."""
        running = {s.request.request_id for s in self.scheduler.running if s.status is SequenceStatus.RUNNING}
        used = self.num_blocks - self.manager.num_free_blocks
        if self.proposer is not None:   # speculative decoding: drafts so far, and how many were kept
            drafts = {"drafts_proposed": self.scheduler.num_proposed, "drafts_accepted": self.scheduler.num_accepted}
        else:
            drafts = {}
        return {**drafts, "running": len(running), "waiting": len(self._live) - len(running),
                "running_sequences": len(self.scheduler.running), "waiting_sequences": len(self.scheduler.waiting),
                "kv_blocks_used": used, "kv_blocks_total": self.num_blocks,
                "kv_block_size": self.manager.block_size, "kv_usage": used / self.num_blocks}

    # --- a whole trace ------------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> EngineResult:
        """Serve every request of a trace (arrival times: seconds from its start) on a fresh engine
        state; per-request records (in the given order) and per-step records. A request refused at
        intake or as impossible gets finish reason "error" and its message; the others are served."""
        requests = list(requests)
        for r in requests:
            _checks.instance("requests[i]", r, Request)
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        if self.scheduler.has_unfinished() or self._live:
            raise RuntimeError("run() needs an idle engine: finish or abort the requests added with add_request")
        self._reset()
        outputs, steps = [], []
        for r in sorted(requests, key=lambda r: r.arrival_time):
            try:
                self.add_request(list(r.prompt), r.sampling, r.request_id, r.arrival_time)
            except ValueError as e:  # refused alone, with its reason
                outputs += [_output(r, k, [], "error", error=f"request {r.request_id!r}: {e}")
                            for k in range(r.sampling.n)]
        while self.has_unfinished():
            outputs += self.step()
            if self.last_step is not None:
                steps.append(self.last_step)
        return EngineResult(outputs=records_from_outputs(requests, outputs), steps=steps, config=self.config,
                            num_blocks=self.num_blocks, capacity_tokens=self.manager.memory_stats().capacity_tokens,
                            bytes_per_token=self.runner.bytes_per_token,
                            free_blocks_at_end=self.manager.num_free_blocks)

    # --- helpers --------------------------------------------------------------------------------------
    def _record(self, batch, start: float, end: float, padding: int) -> StepRecord:
        stats = self.manager.memory_stats()
        return StepRecord(
            start=start, end=end, num_prefills=len(batch.prefills), num_decodes=len(batch.decodes),
            num_tokens=batch.num_tokens,
            tokens_per_sequence=[batch.num_scheduled_tokens[s.seq_id] for s in batch.sequences],
            num_preempted=len(batch.preempted),
            num_padding=padding,
            num_running=len(self.scheduler.running),
            num_waiting=sum(s.request.arrival_time <= end for s in self.scheduler.waiting),
            reserved_tokens=stats.reserved_tokens, used_tokens=stats.used_tokens, logical_tokens=stats.logical_tokens)

    def _fail(self, batch, message: str) -> None:
        """A forward that raised: end every request of the batch with an error and forget the prefix
        cache's names (blocks named this step may hold nothing)."""
        for request_id in {s.request.request_id for s in batch.sequences}:
            live = self._live.pop(request_id, None)
            if live is not None:
                for seq in self.scheduler.abort(request_id):
                    self._pending.append(_output(live.request, seq.sample_index, [], "error", error=message,
                                                 seq=seq, live=live))
        pool = getattr(self.manager, "pool", None)
        if pool is not None:
            pool.clear_prefix_cache()


@dataclasses.dataclass
class _Live:
    """An unfinished request: when it was first scheduled, and how many samples still run."""

    request: Request
    first_scheduled_time: float | None = None
    unfinished: int = 0

    def __post_init__(self):
        self.unfinished = self.request.sampling.n


def _output(request: Request, index: int, new_token_ids: list[int], finish_reason: str | None,
            error: str | None = None, seq: Sequence | None = None, live: _Live | None = None,
            time: float | None = None) -> RequestOutput:
    first = live.first_scheduled_time if live is not None else None
    return RequestOutput(
        request_id=request.request_id, new_token_ids=new_token_ids, finished=finish_reason is not None,
        finish_reason=finish_reason, error=error, index=index, num_prompt_tokens=len(request.prompt),
        num_output_tokens=len(seq.token_ids) - seq.prompt_len if seq is not None else 0,
        num_cached_tokens=seq.num_cached_tokens if seq is not None else 0,
        num_preemptions=seq.num_preemptions if seq is not None else 0, arrival_time=request.arrival_time,
        first_scheduled_time=first, time=time if time is not None else (first or request.arrival_time))


def _step_cost(step_time: Callable[[ScheduledBatch], float], batch: ScheduledBatch) -> float:
    cost = step_time(batch)
    if not _checks._is_number(cost) or not 0 <= cost < float("inf"):
        raise ValueError(f"step_time(batch) must return finite seconds >= 0, got {cost!r}")
    return float(cost)


def _speculative_proposer(model: TransformerLM, c: EngineConfig, draft_model, proposer) -> Proposer | None:
    """The proposer of a speculative engine (None: the plain engine), its configuration checked."""
    if proposer is None and c.speculative is None:
        if draft_model is not None:
            raise ValueError("draft_model is used only with speculative='draft', 'medusa' or 'eagle', got "
                             "speculative=None")
        return None
    if proposer is not None:
        if c.speculative is not None or draft_model is not None:
            raise ValueError(f"give proposer= or speculative= (with draft_model=), not both; got "
                             f"speculative={c.speculative!r} and a proposer")
        if not isinstance(proposer, Proposer):
            raise TypeError(f"proposer must implement the Proposer protocol (needs_features, propose, observe), "
                            f"got {type(proposer).__name__}")
    if c.scheduler != "continuous" or c.kv_layout != "paged":
        raise ValueError(f"speculative decoding runs on the continuous scheduler with the paged KV layout, got "
                         f"scheduler={c.scheduler!r}, kv_layout={c.kv_layout!r}")
    if proposer is None:
        proposer = make_proposer(c.speculative, c.num_speculative_tokens, draft_model, model)
    return proposer


def _check_prompt(prompt_token_ids, vocab_size: int) -> tuple[int, ...]:
    if isinstance(prompt_token_ids, torch.Tensor) or not isinstance(prompt_token_ids, (list, tuple)):
        raise TypeError(f"prompt_token_ids must be a list of int token ids, got {type(prompt_token_ids).__name__}")
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids is empty: a request needs at least one prompt token")
    for t in prompt_token_ids:
        _checks.integer("prompt_token_ids", t, 0, vocab_size - 1, allowed=f"int token ids in [0, {vocab_size})")
    return tuple(prompt_token_ids)


__all__ = ["Engine", "EngineConfig", "EngineResult", "StepRecord"]
