"""A pytest plugin (`-p library_stubs`) that swaps one library function for the stub named by the
environment variable CS336_LIBRARY_STUB (see mutants.LIBRARY_STUBS): the issue's stand-ins for parts of
the library that are not graded. The library tests of that part must fail with the stub in place."""

from __future__ import annotations

import copy
import os

import torch
import torch.nn as nn


def _importance_all_zero():
    from cs336_inference import compression
    from cs336_inference.compression import pruning
    original = pruning.importance_scores

    def stub(model, calibration, *args, **kwargs):
        scores = original(model, calibration, *args, **kwargs)   # the real shapes, every score zero
        return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in scores.items()}
    pruning.importance_scores = compression.importance_scores = stub


def _hardware_constant():
    from cs336_inference.accounting import roofline
    roofline.measure_memory_bandwidth = lambda *args, **kwargs: 20e9    # measure_hardware still checks its
    roofline.measure_matmul_flops = lambda *args, **kwargs: 100e9       # arguments; the numbers are made up


def _quantize_model_times_1_01():
    from cs336_inference import quantization
    from cs336_inference.quantization import model as qmodel

    def stub(model, method="rtn", bits=4, group_size=None, calibration=None, quantize_embedding=False,
             quantize_lm_head=False, **kwargs):
        qmodel._check_args(model, method, bits, group_size, calibration, quantize_embedding, quantize_lm_head)
        out = copy.deepcopy(model)
        with torch.no_grad():
            for module in out.layers.modules():
                if isinstance(module, nn.Linear):
                    module.weight.mul_(1.01)
        out.quantization = {"method": method, "bits": bits, "group_size": group_size}
        return out
    qmodel.quantize_model = quantization.quantize_model = stub


def _ring_forgets_overwritten_slots():
    """Issue 15, hole 10 as a library bug: each commit resets `oldest` from the write alone, so a rolled-back
    draft's overwrites are forgotten once a shorter write follows (a second rollback is then accepted)."""
    from cs336_inference.model import rolling_kv_cache
    original = rolling_kv_cache.RollingKVCache.commit

    def stub(self, step):
        original(self, step)
        self.oldest = step.end - self.capacity
    rolling_kv_cache.RollingKVCache.commit = stub


STUBS = {"importance_all_zero": _importance_all_zero, "hardware_constant": _hardware_constant,
         "quantize_model_times_1_01": _quantize_model_times_1_01,
         "ring_forgets_overwritten_slots": _ring_forgets_overwritten_slots}


def pytest_configure(config):
    name = os.environ.get("CS336_LIBRARY_STUB")
    if name:
        STUBS[name]()
