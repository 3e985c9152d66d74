"""The serving engine over tensor-parallel ranks (nano-vllm's way).

Rank 0 runs the whole `Engine`: the scheduler, the block manager, the sampler. Each step, its runner
turns the scheduled batch into plain host lists (`StepInputs`: token ids, block tables, context and
query lengths, copy-on-write copies) and broadcasts them ONCE to the other ranks; then every rank
runs the same forward on its 1/p of the heads over its own 1/p of the paged KV cache (the pools
hold K/p heads per layer; the block ids are rank 0's, the same on every rank). The row-parallel
all-reduces leave the same logits on every rank, and only rank 0 samples. The other ranks only
follow (`TensorParallelRunner.follow`): receive a step, run it, until rank 0 sends None.

Per step the runner records the seconds in all-reduces and in the broadcast, and whether the step
was a prefill (it holds at least one prefill chunk) or a decode step. A rank that dies is reported
by `launch`, which stops the others (`RankFailedError` naming the rank).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..model.checkpoints import load_pretrained
from ..model.config import ModelConfig
from ..model.transformer import TransformerLM
from ..serving.engine import Engine
from ..serving.model_runner import ModelRunner, StepInputs
from .generate import named_config
from .launch import launch
from .tensor_parallel import check_tensor_parallel, shard_model


@dataclass
class StepCommunication:
    """One step's collectives on one rank: its phase, seconds in all-reduces and in the broadcast."""

    phase: str              # "prefill" (the step holds a prefill chunk) or "decode"
    num_tokens: int
    all_reduce_s: float
    broadcast_s: float


class TensorParallelRunner(ModelRunner):
    """A `ModelRunner` over a sharded model (`shard_model`) that shares each step with the other ranks.

    On rank 0 `execute` broadcasts the step's inputs, then runs them; on the others `follow` receives
    and runs steps until rank 0's `stop`. `steps` holds every step's `StepCommunication`."""

    def __init__(self, model: TransformerLM, num_blocks: int, block_size: int, decode=None, src: int = 0, group=None):
        if getattr(model, "tp_timer", None) is None:
            raise TypeError("TensorParallelRunner needs a sharded model: call shard_model / tensor_parallel first")
        if decode is not None:
            raise ValueError("a tensor-parallel runner runs every step eagerly: decode must be None")
        super().__init__(model, num_blocks, block_size)
        self.timer, self.src, self.group = model.tp_timer, src, group
        self.steps: list[StepCommunication] = []

    def _broadcast(self, step_inputs):
        """Rank src sends `step_inputs` (or None: stop) to every rank; returns (it, seconds)."""
        box = [step_inputs]
        t0 = time.perf_counter()
        dist.broadcast_object_list(box, src=self.src, group=self.group)   # one pickled message per step
        return box[0], time.perf_counter() - t0

    def _run_step(self, step_inputs: StepInputs, broadcast_s: float) -> torch.Tensor:
        phase = "prefill" if step_inputs.num_prefills else "decode"
        before = self.timer.seconds().get(phase, 0.0)
        with self.timer.phase(phase):
            logits = self.run(step_inputs)
        self.steps.append(StepCommunication(phase, len(step_inputs.token_ids),
                                            self.timer.seconds().get(phase, 0.0) - before, broadcast_s))
        return logits

    @torch.inference_mode()
    def execute(self, batch, manager) -> torch.Tensor:
        step_inputs, seconds = self._broadcast(self.inputs(batch, manager))
        return self._run_step(step_inputs, seconds)

    @torch.inference_mode()
    def follow(self) -> int:
        """On a rank other than src: run every step src sends until it sends None; returns the steps run."""
        n = 0
        while True:
            step_inputs, seconds = self._broadcast(None)
            if step_inputs is None:
                return n
            self._run_step(step_inputs, seconds)
            n += 1

    def stop(self) -> None:
        """On src: tell the following ranks that serving is over."""
        self._broadcast(None)

    def communication(self) -> dict:
        """Seconds in collectives per phase: {"prefill": {"all_reduce_s", "broadcast_s", "steps"}, "decode": ...}."""
        out = {}
        for phase in ("prefill", "decode"):
            steps = [s for s in self.steps if s.phase == phase]
            out[phase] = {"all_reduce_s": sum(s.all_reduce_s for s in steps),
                          "broadcast_s": sum(s.broadcast_s for s in steps), "steps": len(steps)}
        return out


class TensorParallelEngine(Engine):
    """`Engine` on rank 0 of a tensor-parallel group: its runner sends each step to the other ranks."""

    def make_runner(self, model, num_blocks, block_size, decode) -> TensorParallelRunner:
        return TensorParallelRunner(model, num_blocks, block_size, decode)


def build_model(source, dtype: torch.dtype | None = None) -> TransformerLM:
    """A model from `source`: a name `load_pretrained` knows, or (ModelConfig, state_dict)."""
    if isinstance(source, str):
        return load_pretrained(source, dtype=dtype).eval()
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[0], ModelConfig):
        model = TransformerLM(source[0])
        model.load_state_dict(source[1])
        return model.to(dtype or model.dtype).eval()
    raise TypeError(f"model must be a pretrained name or (ModelConfig, state_dict), got {type(source).__name__}")


def sharded_engine(source, dtype: torch.dtype | None = None, **engine_options):
    """On this rank (process group joined): shard the model `source` (a name, (ModelConfig, state_dict) or
    a model) and build, on rank 0, the engine over it, elsewhere a runner that follows (the same pool).
    Returns (engine or None, runner)."""
    model = source if isinstance(source, TransformerLM) else build_model(source, dtype)
    if getattr(model, "tp_timer", None) is None:
        model = shard_model(model, dist.get_rank(), dist.get_world_size())
    engine = TensorParallelEngine(model, **engine_options)
    if dist.get_rank() == 0:
        return engine, engine.runner
    return None, engine.runner   # its scheduler stays idle: rank 0 schedules


def _serve_rank(source, runs, dtype, before) -> dict | None:
    model = shard_model(build_model(source, dtype), dist.get_rank(), dist.get_world_size())
    measured = before() if before is not None else None   # every rank: it may run collectives
    out = []
    for requests, engine_options in runs:   # every rank builds the same engine (the same pool) per run
        engine, runner = sharded_engine(model, **engine_options)
        if engine is None:
            runner.follow()
            continue
        try:
            t0 = time.perf_counter()
            result = engine.run(requests)
            seconds = time.perf_counter() - t0
        finally:
            runner.stop()
        out.append({"result": result, "seconds": seconds, "communication": runner.communication(),
                    "steps": [vars(s) for s in runner.steps]})
    return {"runs": out, "before": measured}


def serve_tensor_parallel_runs(model, runs, world_size: int, dtype: torch.dtype | None = None,
                               timeout_s: float | None = None, before=None) -> dict:
    """Serve several traces one after the other on the same `world_size` ranks (started once): runs is a
    list of (requests, engine options); each gets a fresh engine and pool. before: None, or a module-level
    function every rank calls once its model is sharded (e.g. a probe of the links). Returns rank 0's
    {"runs": one record per run, as `serve_tensor_parallel`, "before": what before() returned}."""
    config = named_config(model) if isinstance(model, str) else build_model(model).config
    check_tensor_parallel(config, world_size)   # refused here, before any process starts
    runs = [(list(requests), dict(options)) for requests, options in runs]
    return launch(_serve_rank, world_size, model, runs, dtype, before, timeout_s=timeout_s)


def serve_tensor_parallel(model, requests, world_size: int, dtype: torch.dtype | None = None,
                          timeout_s: float | None = None, **engine_options) -> dict:
    """Serve `requests` (a trace, as `Engine.run`) with the engine over `world_size` local ranks (gloo).
    model: a pretrained name or (ModelConfig, state_dict). Returns rank 0's {"result": EngineResult,
    "seconds", "communication": per phase, "steps": per-step records}. A rank that fails raises
    `RankFailedError` naming it (the others stopped)."""
    return serve_tensor_parallel_runs(model, [(requests, engine_options)], world_size, dtype, timeout_s)["runs"][0]


__all__ = ["StepCommunication", "TensorParallelEngine", "TensorParallelRunner", "serve_tensor_parallel",
           "serve_tensor_parallel_runs", "sharded_engine"]
