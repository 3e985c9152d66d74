"""`bench inference`: bad arguments are refused by name before anything runs, and a tiny sweep on the
shipped target writes strict JSON and a CSV whose numbers agree with each other (timings themselves are
the benchmark's business, not the tests')."""

import csv
import json
import math

import pytest

from cs336_inference import cli
from cs336_inference.workshop.benchmarks.inference import bench_inference, run_benchmark
from cs336_inference.workshop.benchmarks.inference_sweep import SPARSE_RATE, SweepConfig, operating_points
from cs336_inference.serving import Workload


@pytest.mark.parametrize("kwargs, name", [
    (dict(preset="lunch"), "preset"),
    (dict(preset="chat", concurrency=0), "concurrency"),
    (dict(preset="chat", output_len=0), "output_len"),
    (dict(preset="chat", concurrency=2.5), "concurrency"),
    (dict(concurrency=4), "preset"),            # an override needs the operating point it overrides
])
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name) as info:
        bench_inference(quick=True, device="cpu", **kwargs)
    if name in kwargs:   # the value given is quoted too
        assert repr(kwargs[name]) in str(info.value)


def test_sweep_and_runner_refuse():
    with pytest.raises(ValueError, match="concurrencies"):
        SweepConfig(concurrencies=(4, 0))
    with pytest.raises(ValueError, match="output_lens"):
        SweepConfig(output_lens=(0,))
    with pytest.raises(ValueError, match="precisions"):
        SweepConfig(precisions=("fp8",))
    with pytest.raises(ValueError, match="concurrency"):
        run_benchmark(None, [], concurrency=0)
    with pytest.raises(ValueError, match="speculative"):
        SweepConfig(speculative=("eagle",))
    with pytest.raises(ValueError, match="draft"):   # the shipped draft drafts for the shipped target only
        bench_inference(quick=True, device="cpu", model="smollm2-135m", sweep=SweepConfig())
    with pytest.raises(ValueError, match="server"):
        run_benchmark(None, [object()], concurrency=1, server="vllm")


def test_cli_refuses_options_a_bench_does_not_take(capsys):
    assert cli.main(["bench", "serving", "--model", "smollm2-135m"]) == 2
    assert "--model" in capsys.readouterr().err


def tiny_sweep() -> SweepConfig:
    points = {k: w.replace(num_requests=2, output_len=3, concurrency=min(w.concurrency, 4),
                           samples=min(w.samples, 2)) for k, w in operating_points(False).items()}
    return SweepConfig(precisions=("fp32", "int8"), concurrencies=(1, 2),
                       concurrency_base=Workload("concurrency", (8, 8), 3, 1, 2), prompt_lens=(8, 24),
                       prompt_base=Workload("prompt_len", (8, 8), 2, 1, 2, rate=SPARSE_RATE), output_lens=(1, 3),
                       output_base=Workload("output_len", (8, 8), 1, 2, 2), presets=points,
                       warmup=Workload("warmup", (8, 8), 2, 1, 1), quality_windows=(16, 1), repeats=2,
                       speculative_requests=2)


def test_tiny_sweep_writes_strict_json_csv_and_plots(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("CS336_FIGURES", str(tmp_path))
    bench_inference(quick=True, device="cpu", progress=False, sweep=tiny_sweep())
    written = {p.name for p in tmp_path.iterdir()}
    assert {"inference_quick.json", "inference_quick.csv", "inference_operating_points_quick.png",
            "inference_ttft_quick.png"} <= written

    def no_nan(token):
        raise AssertionError(f"JSON has {token}: not strict JSON")

    data = json.loads((tmp_path / "inference_quick.json").read_text(), parse_constant=no_nan)
    rows = data["rows"]
    assert {r["axis"] for r in rows} == {"preset", "kv_layout", "speculative", "concurrency", "prompt_len",
                                         "output_len"}
    # presets x precisions, contiguous chat, 3 speculative modes, axes x precisions
    assert len(rows) == 2 * 3 + 1 + 3 + 2 * (2 + 2 + 2)
    assert data["machine"]["cpu"] and data["machine"]["torch_threads"] == 1
    assert set(data["quality"]) == {"fp32", "int8"}
    assert data["quality"]["fp32"]["kl_to_fp32"] == pytest.approx(0, abs=1e-6)
    for r in rows:
        assert r["repeats"] == 2 and r["output_throughput_min"] <= r["output_throughput"] <= r["output_throughput_max"]
        tokens = r["input_tokens"] + r["output_tokens"]
        assert r["total_token_throughput"] * r["duration_s"] == pytest.approx(tokens)
        assert r["weight_bytes"] > 0 and r["rss_peak_bytes"] > 0
        if r["axis"] in ("output_len", "concurrency", "prompt_len"):   # no stop tokens: exact output lengths
            assert r["output_tokens"] == r["num_requests"] * r["output_len"]
        if r["axis"] == "output_len" and r["output_len"] == 1:
            assert r["tpot_mean_s"] is None and r["itl_p99_s"] is None   # single-token requests
        if r["axis"] == "prompt_len":   # one request at a time: TTFT is all prefill
            assert r["queueing_median_s"] == pytest.approx(0, abs=1e-9)
    spec = {r["speculative"]: r for r in rows if r["axis"] == "speculative"}
    assert set(spec) == {"off", "prompt_lookup", "draft"}
    for r in spec.values():   # greedy chat answers: speculative decoding must reproduce plain decoding
        assert r["server"] == "one_at_a_time" and r["same_tokens_as_plain"] == 1.0
        assert r["queueing_median_s"] == pytest.approx(0, abs=1e-9)
    assert spec["draft"]["spec_tokens_per_pass"] >= 1 and spec["off"]["spec_passes"] == 0
    for r in (r for r in rows if r["axis"] == "preset"):
        for q in r["requests"]:
            assert q["queueing_s"] + q["prefill_s"] + q["decode_s"] == pytest.approx(q["e2el_s"])

    with open(tmp_path / "inference_quick.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    for line, r in zip(table, rows):
        assert line["cpu"] == data["machine"]["cpu"] and line["precision"] == r["precision"]
        assert math.isclose(float(line["output_throughput"]), r["output_throughput"], rel_tol=1e-9)
