"""Bad inputs a careless user tries, each refused clearly (TypeError/ValueError naming the argument)
or handled, and user-owned state (model, cache, checkpoint file, shipped assets) left intact."""

import hashlib
import io
import os

import pytest
import torch
import torch.nn as nn
from smollm2_reference import requires_smollm2
from adapters import (get_tokenizer, make_config, make_kv_cache, make_model, make_quantized_linear, make_train_config,
                      run_generate, run_load_checkpoint, run_model, run_prefill, run_quantize_model,
                      run_save_checkpoint, run_train_lm)

from cs336_inference.generation import sample_next_token
from cs336_inference.quantization import quantize

CFG = dict(vocab_size=257, context_length=32, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def model():
    return make_model(make_config(**CFG))


# --- training and checkpoints -----------------------------------------------------------------


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_training_resume_never_unpickles_arbitrary_objects(tmp_path):
    marker = str(tmp_path / "code-ran")
    path = tmp_path / "resume.pt"
    torch.save({"model_config": _Exploit(marker)}, path)
    cfg = make_train_config(steps=2, batch_size=2, seq_len=16, eval_every=2, eval_batches=1, progress=False,
                            checkpoint_path=str(path))
    with pytest.raises(ValueError, match="resume.pt"):
        run_train_lm(make_config(**CFG), cfg, resume=True)
    assert not os.path.exists(marker), "loading the resume file executed code from it"


def _assets_digest():
    from cs336_inference.model.checkpoints import ASSETS
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ASSETS.glob("*.pt"))}


def test_train_without_out_never_overwrites_the_shipped_models(tmp_path, monkeypatch, capsys):
    from cs336_inference import cli, shipped_models
    monkeypatch.setattr(shipped_models, "EVAL", shipped_models.QUICK_EVAL)   # keep the smoke run short
    monkeypatch.chdir(tmp_path)
    before = _assets_digest()
    assert cli.main(["train", "--preset", "draft-scratch", "--steps", "1", "--no-progress"]) == 0
    assert _assets_digest() == before, "train without --out rewrote a shipped model"
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.pt"))
    assert written and str(written[0]) in capsys.readouterr().out, "the new file's path must be printed"
    # A second run writes another new file, never over the first one.
    assert cli.main(["train", "--preset", "draft-scratch", "--steps", "1", "--no-progress"]) == 0
    assert len(list(tmp_path.rglob("*.pt"))) == 2


def test_train_with_a_bad_out_fails_before_training(tmp_path, monkeypatch, capsys):
    from cs336_inference import cli, shipped_models

    def no_training(*args, **kwargs):
        raise AssertionError("training started although --out is unusable")
    monkeypatch.setattr(shipped_models, "train_lm", no_training)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for bad in (blocker / "model.pt", tmp_path):                  # parent is a file; out is a directory
        assert cli.main(["train", "--preset", "draft-scratch", "--steps", "1", "--out", str(bad)]) == 2
        err = capsys.readouterr().err                              # one line naming --out, no traceback
        assert len(err.strip().splitlines()) == 1 and "out" in err and "Traceback" not in err


def test_a_failed_save_leaves_the_old_file_intact_and_no_partial_file(model, tmp_path, monkeypatch):
    path = tmp_path / "m.pt"
    run_save_checkpoint(path, model)
    before = path.read_bytes()
    real_save = torch.save

    def dies_halfway(obj, f, *args, **kwargs):
        if not isinstance(f, (str, os.PathLike)):       # in-memory checks are not the write that fails
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer)
        with open(f, "wb") as out:
            out.write(buffer.getvalue()[:100])
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(OSError, match="disk full"):
        run_save_checkpoint(path, make_model(make_config(**CFG), seed=1))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"], "a partial temp file was left behind"
    run_load_checkpoint(path)


def test_save_refuses_extra_that_cannot_be_loaded_back_safely_and_integer_dtypes(model, tmp_path):
    with pytest.raises(ValueError, match="extra"):
        run_save_checkpoint(tmp_path / "m.pt", model, extra={"model_class": nn.Linear})
    with pytest.raises(ValueError, match="dtype"):
        run_save_checkpoint(tmp_path / "m.pt", model, dtype=torch.int8)
    with pytest.raises(TypeError, match="dtype"):
        run_save_checkpoint(tmp_path / "m.pt", model, dtype="bf16")
    assert not any(tmp_path.iterdir()), "a refused save must write nothing"
    run_save_checkpoint(tmp_path / "m.pt", model, extra={"val": {"loss": 1.5}, "steps": [1, 2]}, dtype=torch.bfloat16)
    run_load_checkpoint(tmp_path / "m.pt")


# --- the model, the cache, generation ---------------------------------------------------------


def test_prefill_of_a_1d_prompt_is_one_sequence(model):
    prompt = torch.randint(0, 257, (7,))
    with torch.no_grad():
        got = run_prefill(model, prompt, make_kv_cache(model, 1))
        want = run_model(model, prompt[None])[:, -1]
    assert got.shape == (1, 257)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_cache_used_with_gradients_enabled_does_not_track_them(model):
    cache = make_kv_cache(model, 1, 20)
    logits = run_model(model, torch.randint(0, 257, (1, 5)), cache)    # no torch.no_grad() here
    logits = run_model(model, torch.randint(0, 257, (1, 1)), cache)
    assert logits.requires_grad, "the forward itself still builds a graph for the new tokens"
    for layer in cache.layers:
        assert not layer.k.requires_grad and layer.k.grad_fn is None, "the cache joined the autograd graph"
    logits.sum().backward()                                            # and the graph is a usable one
    assert model.layers[0].attn.k_proj.weight.grad is not None


@pytest.mark.parametrize("stop", [10, torch.tensor(10), torch.tensor([10, 11]), [10, 11], (10,), {10}])
def test_stop_tokens_may_be_an_int_a_tensor_or_a_collection(model, stop):
    greedy = run_generate(model, [[1, 2, 3]], 6).tokens[0]
    forced = make_model(make_config(**CFG))          # its logits always pick token 10
    forced.lm_head.register_forward_hook(lambda m, i, out: torch.zeros_like(out).index_fill_(-1, torch.tensor([10]), 1))
    out = run_generate(forced, [[1, 2, 3]], 6, stop_tokens=stop)
    assert out.tokens == [[10]] and out.finish_reasons == ["stop"], f"stop_tokens={stop!r} was not honoured"
    assert run_generate(model, [[1, 2, 3]], 6, stop_tokens=[]).tokens[0] == greedy


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(stop_tokens=[1.5]), TypeError, "stop_tokens"),
    (dict(stop_tokens=torch.tensor([1.0])), TypeError, "stop_tokens"),
    (dict(stop_tokens="10"), TypeError, "stop_tokens"),
    (dict(stop_tokens=[999]), ValueError, "stop_tokens"),
    (dict(pad_id=-1), ValueError, "pad_id"),
    (dict(pad_id=300), ValueError, "pad_id"),
    (dict(pad_id=0.5), TypeError, "pad_id"),
    (dict(generator=0, temperature=1.0), TypeError, "generator"),
])
def test_bad_stop_tokens_pad_id_and_generator_are_named(model, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        run_generate(model, [[1, 2, 3], [4]], 3, **kwargs)


def test_sample_next_token_names_a_bad_generator():
    with pytest.raises(TypeError, match="generator"):
        sample_next_token(torch.zeros(2, 5), temperature=1.0, generator=7)


@pytest.mark.parametrize("field", ["rope_theta", "norm_eps"])
@pytest.mark.parametrize("value, exc", [(True, TypeError), ("1e4", TypeError), (float("inf"), ValueError),
                                        (float("nan"), ValueError), (-1.0, ValueError), (0, ValueError)])
def test_rope_theta_and_norm_eps_are_finite_positive_floats(field, value, exc):
    with pytest.raises(exc, match=field):
        make_config(**{**CFG, field: value})


def test_uint8_token_ids_are_accepted(model):
    ids = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(run_model(model, ids.to(torch.uint8)), run_model(model, ids), atol=0, rtol=0)


@pytest.mark.parametrize("other", [dict(num_kv_heads=4), dict(num_layers=4), dict(sliding_window=4),
                                   dict(attention_type="mla", kv_lora_rank=8, rope_head_dim=4, num_kv_heads=None)])
def test_a_cache_built_for_another_model_shape_is_refused(model, other):
    cache = make_kv_cache(make_model(make_config(**{**CFG, **other})), 1)
    with pytest.raises(ValueError, match="new_cache"):
        run_model(model, torch.randint(0, 257, (1, 3)), cache)
    assert cache.length == 0


def test_byte_tokenizer_refuses_a_string_of_special_tokens():
    with pytest.raises(TypeError, match="special_tokens"):
        get_tokenizer(special_tokens="<|endoftext|>")
    with pytest.raises(TypeError, match="special_tokens"):
        get_tokenizer(special_tokens=["<|a|>", 3])


# --- quantization -----------------------------------------------------------------------------


def test_quantizing_an_already_quantized_model_is_refused(model):
    once = run_quantize_model(model, "rtn", bits=4, group_size=16)
    with pytest.raises(ValueError, match="already quantized"):
        run_quantize_model(once, "rtn", bits=8)
    assert once.quantization["bits"] == 4


def test_llm_int8_threshold_is_checked_at_construction():
    with pytest.raises(ValueError, match="threshold"):
        make_quantized_linear(nn.Linear(8, 4, bias=False), "llm_int8", threshold=-1.0)


@pytest.mark.parametrize("kind", ["int4", "fp8", "llm_int8"])
def test_quantized_linears_keep_the_bias(kind):
    torch.manual_seed(0)
    linear = nn.Linear(32, 8)
    without = nn.Linear(32, 8, bias=False)
    with torch.no_grad():
        linear.bias.copy_(torch.randn(8))
        without.weight.copy_(linear.weight)
    x = torch.randn(5, 32)
    with torch.no_grad():   # the same weight path, plus exactly the bias
        got = make_quantized_linear(linear, kind)(x) - make_quantized_linear(without, kind)(x)
    torch.testing.assert_close(got, linear.bias.expand(5, 8), atol=1e-5, rtol=0)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0, 0.0])
def test_non_finite_or_non_positive_scales_are_refused(scale):
    with pytest.raises(ValueError, match="scale"):
        quantize(torch.randn(4, 8), scale, 0, 8)
    with pytest.raises(ValueError, match="scale"):
        quantize(torch.randn(4, 8), torch.tensor([[1.0], [scale], [1.0], [1.0]]), 0, 8)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool, "float32"])
def test_a_cache_of_a_non_float_dtype_is_refused_by_name(dtype):
    """An integer cache would round every key and value (a silently wrong decode): refused where it is built."""
    from cs336_inference.serving import PagedKVCache

    model = make_model(make_config(**{"vocab_size": 257, "context_length": 32, "d_model": 32, "num_layers": 2,
                                      "num_heads": 4, "num_kv_heads": 2, "d_ff": 64}))
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        model.new_cache(1, dtype=dtype)
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        PagedKVCache(model, num_blocks=4, block_size=4, dtype=dtype)
    assert model.to(torch.bfloat16).new_cache(1, dtype=torch.bfloat16).layers[0].k.dtype == torch.bfloat16


@pytest.mark.parametrize("variant", [{}, {"sliding_window": 4}])
def test_a_cache_of_another_float_dtype_than_the_models_is_refused_at_new_cache(variant):
    """A float16 cache on a float32 model was accepted and the first forward failed inside torch (index_put,
    on a sliding window) or kept keys rounded to fp16 while the model ran fp32: refused where it is built."""
    from cs336_inference.serving import PagedKVCache

    model = make_model(make_config(**{**CFG, **variant}))
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        with pytest.raises(ValueError, match=rf"dtype={dtype}.*model's dtype torch.float32"):
            model.new_cache(1, dtype=dtype)
    if not variant:
        with pytest.raises(ValueError, match=r"dtype=torch.float16.*model's dtype torch.float32"):
            PagedKVCache(model, num_blocks=4, block_size=4, dtype=torch.float16)
    cache = model.new_cache(1, dtype=torch.float32)       # the model's own dtype, named, is fine
    run_model(model, torch.tensor([[1, 2, 3]]), cache=cache)
    assert cache.length == 3


def test_generate_checks_the_prompt_ids_even_when_nothing_is_generated(model):
    with pytest.raises(ValueError, match=r"prompt_ids must be in \[0, vocab_size=257\).*999"):
        run_generate(model, [[999]], 0)
    with pytest.raises(ValueError, match="prompt_ids"):
        run_generate(model, [[5, -1]], 0)
    assert run_generate(model, [[5, 6]], 0).tokens == [[]]


@requires_smollm2
def test_bpe_decode_refuses_non_int_ids_by_name():
    """int(65.7) is 65, so decode([65.7]) returned token 65's text ('Q')."""
    import numpy as np

    from cs336_inference.model import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    for bad in ([65.7], [65, 66.0], [True], np.array([65.7]), torch.tensor([65.0])):
        with pytest.raises(TypeError, match="ids must hold int"):
            tok.decode(bad)
    ids = tok.encode("int ids decode")
    assert tok.decode(ids) == tok.decode(np.array(ids)) == tok.decode(torch.tensor(ids)) == "int ids decode"


def test_a_cache_longer_than_the_context_is_refused_before_rope_runs_out_of_angles():
    """A cache from a model with a longer context (or a paged step past it) indexed past the RoPE table:
    an IndexError from inside the forward. Refused by name at the edge (the cache's first forward, the
    paged step built from host lists), and a failed call leaves the cache as it was."""
    from cs336_inference.serving import PagedKVCache

    short = make_model(make_config(**{**CFG, "context_length": 16}))
    long_cache = make_model(make_config(**{**CFG, "context_length": 64})).new_cache(1)
    with pytest.raises(ValueError, match="max_seq_len=64.*context_length 16"):
        run_model(short, torch.tensor([[1, 2]]), cache=long_cache)
    assert long_cache.length == 0
    cache = short.new_cache(1)
    run_model(short, torch.ones(1, 16, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="cache overflow"):
        run_model(short, torch.tensor([[1]]), cache=cache)
    assert cache.length == 16
    paged = PagedKVCache(short, num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="17 tokens exceeds the model's context_length 16"):
        paged.step([[0, 1, 2, 3, 4]], [17], [1])
    step = paged.step([[0, 1, 2, 3]], [16], [16])             # the longest that fits runs
    assert run_model(short, torch.ones(1, 16, dtype=torch.long), step=step).shape == (1, 16, CFG["vocab_size"])
