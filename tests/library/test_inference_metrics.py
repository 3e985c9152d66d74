"""Serving metrics (vLLM's definitions) from synthetic timestamps, each expected value computed here by
hand or by a naive loop: TTFT, TPOT = (E2E - TTFT) / (output - 1), ITL, E2E, the queueing / prefill /
decode split, throughputs, and mean / median / p99 with few samples."""

import math

import pytest

import adapters


def naive_percentile(values, q):
    """Linear interpolation between closest ranks (numpy's default), written out."""
    xs = sorted(values)
    rank = q / 100 * (len(xs) - 1)
    lo = int(math.floor(rank))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (rank - lo) * (xs[hi] - xs[lo])


def naive_median(values):
    xs = sorted(values)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


# Three requests: A (4 tokens, queued), B (a single output token), C (n = 2 samples of 3 and 2 tokens).
A = dict(request_id="A", prompt_len=10, arrival_time=0.0, first_scheduled_time=0.5,
         token_times=[[1.0, 1.25, 1.75, 2.5]])
B = dict(request_id="B", prompt_len=7, arrival_time=1.0, first_scheduled_time=1.0, token_times=[[1.5]])
C = dict(request_id="C", prompt_len=5, arrival_time=0.25, first_scheduled_time=0.375,
         token_times=[[0.75, 1.0, 1.25], [0.75, 0.875]])


def outputs(*specs):
    return [adapters.make_request_output(**s) for s in specs]


def test_request_metrics_by_hand():
    a, b, c = (adapters.run_request_metrics(o) for o in outputs(A, B, C))
    # A: TTFT 1.0 - 0.0; E2E 2.5; TPOT (2.5 - 1.0) / (4 - 1); ITL the three gaps; split 0.5 / 0.5 / 1.5
    assert a.ttft == pytest.approx(1.0) and a.e2el == pytest.approx(2.5)
    assert a.tpot == pytest.approx(0.5)
    assert a.itls == pytest.approx((0.25, 0.5, 0.75))
    assert (a.queueing, a.prefill, a.decode) == pytest.approx((0.5, 0.5, 1.5))
    assert a.queueing + a.prefill + a.decode == pytest.approx(a.e2el)
    assert a.output_tokens == 4 and a.prompt_tokens == 10
    # B: one output token: no TPOT (vLLM leaves such requests out of TPOT), no ITL, no decode time
    assert b.ttft == pytest.approx(0.5) and b.e2el == pytest.approx(0.5)
    assert b.tpot is None and b.itls == () and b.decode == 0.0
    # C: first token of any sample, last token of any sample, longest sample has 3 tokens
    assert c.ttft == pytest.approx(0.5) and c.e2el == pytest.approx(1.0)
    assert c.tpot == pytest.approx((1.0 - 0.5) / (3 - 1))
    assert sorted(c.itls) == pytest.approx(sorted([0.25, 0.25, 0.125]))
    assert c.output_tokens == 5
    assert (c.queueing, c.prefill, c.decode) == pytest.approx((0.125, 0.375, 0.5))


def test_tokens_arriving_together_are_one_chunk():
    """A speculative pass emits several tokens at one instant: ITL counts gaps between chunks (what a
    stream delivers); TPOT still divides by every token after the first."""
    m = adapters.run_request_metrics(adapters.make_request_output(
        "s", 3, 0.0, [[1.0, 1.5, 1.5, 1.5, 2.0]], first_scheduled_time=0.0))
    assert m.itls == pytest.approx((0.5, 0.5))
    assert m.tpot == pytest.approx((2.0 - 1.0) / 4)


def test_benchmark_metrics_aggregate_independently():
    outs = outputs(A, B, C)
    got = adapters.run_benchmark_metrics(outs)
    ttft = [1.0, 0.5, 0.5]
    e2el = [2.5, 0.5, 1.0]
    tpot = [0.5, 0.25]                                   # B has one output token: left out
    itl = [0.25, 0.5, 0.75, 0.25, 0.25, 0.125]           # pooled over every request's gaps
    duration = 2.5 - 0.0                                 # first arrival -> last token
    assert got["completed"] == 3
    assert got["duration_s"] == pytest.approx(duration)
    assert got["input_tokens"] == 22 and got["output_tokens"] == 10
    assert got["output_throughput"] == pytest.approx(10 / duration)
    assert got["total_token_throughput"] == pytest.approx(32 / duration)
    assert got["request_throughput"] == pytest.approx(3 / duration)
    for key, values in (("ttft", ttft), ("e2el", e2el), ("tpot", tpot), ("itl", itl)):
        assert got[key]["mean"] == pytest.approx(sum(values) / len(values)), key
        assert got[key]["median"] == pytest.approx(naive_median(values)), key
        assert got[key]["p99"] == pytest.approx(naive_percentile(values, 99)), key
    # p99 of three values interpolates between the two largest: 0.5 + 0.98 * (1.0 - 0.5)
    assert got["ttft"]["p99"] == pytest.approx(0.99)
    # p99 of two TPOTs: 0.25 + 0.99 * 0.25
    assert got["tpot"]["p99"] == pytest.approx(0.4975)
    assert got["queueing"]["mean"] == pytest.approx((0.5 + 0.0 + 0.125) / 3)
    assert got["decode"]["median"] == pytest.approx(0.5)


def test_single_token_requests_and_explicit_duration():
    outs = outputs(B, dict(B, request_id="B2", arrival_time=2.0, first_scheduled_time=2.25, token_times=[[3.0]]))
    got = adapters.run_benchmark_metrics(outs, duration=4.0)
    assert math.isnan(got["tpot"]["mean"]) and math.isnan(got["itl"]["p99"])   # nothing to average
    assert got["ttft"]["p99"] == pytest.approx(naive_percentile([0.5, 1.0], 99))
    assert got["output_throughput"] == pytest.approx(2 / 4.0)
    assert got["decode"]["mean"] == 0.0


def test_metrics_refuse_empty_runs():
    with pytest.raises(ValueError, match="outputs"):
        adapters.run_benchmark_metrics([])
    with pytest.raises(ValueError, match="no output token"):
        adapters.run_request_metrics(adapters.make_request_output("x", 3, 0.0, [[]]))
    with pytest.raises(ValueError, match="duration"):
        adapters.run_benchmark_metrics(outputs(A), duration=0.0)
