"""The server's pieces without a server: streamed detokenization with stop strings, and the request
bodies' validation (each refusal names its parameter)."""

import random

import pytest

pytest.importorskip("pydantic")

from cs336_inference.model import ByteTokenizer  # noqa: E402
from cs336_inference.serving.http.detokenizer import IncrementalDetokenizer  # noqa: E402
from cs336_inference.serving.http.protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError,  # noqa: E402
                                                   parse_body)


def stream_text(tokens, stop=(), chunk=1, skip=()):
    detok, pieces = IncrementalDetokenizer(ByteTokenizer(), stop, skip), []
    for i in range(0, len(tokens), chunk):
        pieces.append(detok.push(tokens[i:i + chunk], final=i + chunk >= len(tokens)))
        if detok.stopped:
            break
    return pieces, detok


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_streamed_text_is_the_whole_decode_split_characters_included(chunk):
    text = "naïve café — ünïcödé ✓ 数据 " * 3
    tokens = list(text.encode("utf-8"))
    pieces, detok = stream_text(tokens, chunk=chunk)
    assert "".join(pieces) == text and detok.num_tokens == len(tokens)
    assert all("\ufffd" not in p for p in pieces)          # never half a character


def test_stop_strings_end_the_text_before_them_even_across_pieces():
    rng = random.Random(0)
    for _ in range(200):
        words = [rng.choice(["ab", "c", "STOP", "ST", "OPx", "é", " "]) for _ in range(12)]
        text = "".join(words)
        tokens = list(text.encode("utf-8"))
        stops = ["STOP", "xé"]
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        expected = text[:min(hits)] if hits else text
        for chunk in (1, 3):
            pieces, detok = stream_text(tokens, stops, chunk)
            assert "".join(pieces) == expected, (text, chunk)
            assert detok.stopped == bool(hits)
            assert not any(s in "".join(pieces) for s in stops)


def test_skipped_end_tokens_are_counted_but_not_shown():
    pieces, detok = stream_text([104, 105, 256], skip=[256])
    assert "".join(pieces) == "hi" and detok.num_tokens == 3


def refusal(model, body: str) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse_body(model, body.encode())
    assert info.value.status == 400 and info.value.message
    return info.value


def test_bodies_are_validated_strictly_and_refusals_name_the_parameter():
    ok = parse_body(CompletionRequest, b'{"model": "m", "prompt": [[1, 2], "text"], "n": 2, "stop": "x"}')
    assert ok.prompt == [[1, 2], "text"] and ok.stop == ["x"] and ok.max_tokens == 16 and ok.temperature == 1.0
    chat = parse_body(ChatCompletionRequest, b'{"model": "m", "messages": [{"role": "user", "content": '
                                             b'[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], '
                                             b'"max_completion_tokens": 5}')
    assert chat.messages[0].content == "ab" and chat.max_tokens == 5
    assert refusal(CompletionRequest, '{"model": "m", "prompt": "x", "n": true}').param == "n"
    assert refusal(CompletionRequest, '{"model": "m", "prompt": "x", "top_k": 2.5}').param == "top_k"
    assert refusal(CompletionRequest, '{"model": "m", "prompt": [1, -1.5]}').param == "prompt"
    assert refusal(CompletionRequest, '{"model": "m", "prompt": "x", "echo": true}').param == "echo"
    too_many = '{"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}'
    assert refusal(CompletionRequest, too_many).param == "stop"
    both = '{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 4}'
    assert refusal(ChatCompletionRequest, both).param == "max_completion_tokens"
    assert refusal(ChatCompletionRequest, '{"model": "m"}').message == "messages is required"
    assert refusal(ChatCompletionRequest, 'nope').param is None


def test_seeds_and_stop_token_ids_are_refused_by_name_before_the_engine():
    body = '{"model": "m", "prompt": %s, "n": %d, "seed": %d}'
    assert parse_body(CompletionRequest, (body % ('["a", "b"]', 2, 2**64 - 4)).encode()).num_choices == 4
    for prompt, n, seed in [('"a"', 1, 2**70), ('"a"', 1, -1), ('["a", "b"]', 2, 2**64 - 4 + 1), ('"a"', 3, 2**64 - 2)]:
        error = refusal(CompletionRequest, body % (prompt, n, seed))
        assert error.param == "seed" and "seed" in error.message and "Overflow" not in error.message
    chat = '{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2, "seed": %d}'
    assert refusal(ChatCompletionRequest, chat % (2**64 - 1)).param == "seed"
    assert parse_body(ChatCompletionRequest, (chat % (2**64 - 2)).encode()).seed == 2**64 - 2
    assert refusal(CompletionRequest, '{"model": "m", "prompt": "x", "stop_token_ids": [3, -1]}').param == \
        "stop_token_ids.1"


def test_library_refusals_are_mapped_to_the_field_they_name():
    from cs336_inference.serving.http.protocol import param_of
    from cs336_inference.serving.request import SamplingParams

    for kwargs, field in [({"seed": 2**70}, "seed"), ({"top_k": 0}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
                          ({"stop_token_ids": [-1]}, "stop_token_ids")]:
        with pytest.raises((ValueError, TypeError)) as info:
            SamplingParams(**kwargs)
        assert param_of(info.value) == field, info.value
    assert param_of(ValueError("prompt_token_ids must be int token ids in [0, 257), got 999")) == "prompt"
    assert param_of(ValueError("something else went wrong")) is None


def test_histogram_counts_equal_a_recount_of_the_observations():
    from cs336_inference.serving.http.prometheus import Histogram

    rng = random.Random(0)
    bounds = (0.001, 0.01, 0.1, 1.0)
    values = [rng.choice([0.001, 0.1, 5.0]) if i % 7 == 0 else rng.expovariate(20) for i in range(500)]
    h = Histogram("x_seconds", "help", bounds)
    for v in values[:-10]:
        h.observe(v)
    h.observe(values[-10], times=10)                          # one interval shared by 10 tokens
    observed = values[:-10] + [values[-10]] * 10
    lines = h.lines('model_name="m"')
    assert lines[:2] == ["# HELP cs336:x_seconds help", "# TYPE cs336:x_seconds histogram"]
    for bound, line in zip([*bounds, float("inf")], lines[2:-2]):
        le = "+Inf" if bound == float("inf") else str(bound)
        assert line == f'cs336:x_seconds_bucket{{model_name="m",le="{le}"}} {sum(v <= bound for v in observed)}'
    assert lines[-2] == f'cs336:x_seconds_sum{{model_name="m"}} {h.sum}' and h.sum == pytest.approx(sum(observed))
    assert lines[-1] == f'cs336:x_seconds_count{{model_name="m"}} {len(observed)}'
    with pytest.raises(ValueError, match="increasing"):
        Histogram("y", "help", (0.1, 0.01))
