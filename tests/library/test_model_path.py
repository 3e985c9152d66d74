"""`--model PATH` for chat, generate and serve (model_source.py): a file this project's `save` (or `train --out`)
wrote, and a CS336 assignment-1 checkpoint in a student's layout (tests/student_layouts.py) with its config from
a JSON file or flags, each loading to the logits of the model that wrote it; the tokenizer chosen or named; and
one clear line for a missing file, an unreadable one, a missing or mismatched config, a tokenizer that cannot
fit."""

import json

import pytest
import torch
from adapters import run_save_checkpoint
from student_layouts import LAYOUTS, Arch, StudentLM

from cs336_inference import cli
from cs336_inference.workshop.fast_path import load_for_inference
from cs336_inference.model import ByteTokenizer, ModelConfig, TransformerLM
from cs336_inference.model_source import TokenizerFile, resolve

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = torch.randint(0, 257, (1, 12), generator=torch.Generator().manual_seed(0))
ARCH = Arch(vocab=257)   # the byte tokenizer's vocabulary: no --tokenizer needed
CONFIG = dict(vocab_size=257, context_length=64, d_model=ARCH.d_model, num_layers=ARCH.layers, num_heads=ARCH.heads,
              num_kv_heads=ARCH.kv_heads, d_ff=ARCH.d_ff)


@pytest.fixture(scope="module")
def own_file(tmp_path_factory):
    """A tiny model saved as `train --out` saves (checkpoints.save), and the model itself."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.from_name("tiny")).eval()
    path = tmp_path_factory.mktemp("own") / "tiny.pt"
    run_save_checkpoint(path, model)
    return path, model


@pytest.fixture(scope="module")
def student_file(tmp_path_factory):
    """An assignment-1 checkpoint as its save_checkpoint writes it (model, optimizer, iteration), in a
    student's own key names, and its config as a JSON file with training keys beside the model's."""
    student = StudentLM(ARCH, LAYOUTS["mha_r_w_Q_swiglu_ff_linear_W_g"], seed=3)
    folder = tmp_path_factory.mktemp("student")
    torch.save({"model": student.state_dict(), "optimizer": {"state": {}}, "iteration": 5000}, folder / "ckpt.pt")
    (folder / "config.json").write_text(json.dumps({**CONFIG, "lr": 3e-4, "batch_size": 32}))
    return folder, student


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids)[0].float()


def test_a_file_save_wrote_loads_as_the_model_that_wrote_it(own_file, capsys):
    path, model = own_file
    loaded, tokenizer, banner = load_for_inference(str(path))
    assert banner.startswith(f"{path}: fp32 weights") and isinstance(tokenizer, ByteTokenizer)
    assert (_logits(loaded, IDS[:, :8]) - _logits(model, IDS[:, :8])).abs().max() < 1e-4
    assert cli.main(["generate", "--model", str(path), "--prompt", "ab", "--max-new-tokens", "4", "--no-compile"]) == 0
    assert "4 tokens" in capsys.readouterr().err


def test_an_assignment1_checkpoint_loads_with_its_config_from_json_or_flags(student_file, capsys):
    folder, student = student_file
    want = student(IDS)[0]
    source = resolve(str(folder / "ckpt.pt"), config=json.loads((folder / "config.json").read_text()))
    model, tokenizer, _ = load_for_inference(source)
    assert (_logits(model) - want).abs().max() < 1e-4 and isinstance(tokenizer, ByteTokenizer)
    assert "key_map='auto' placed" in capsys.readouterr().err   # the mapping it found, on stderr (stdout: answers)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in CONFIG.items()]
    for how in (["--config", str(folder / "config.json")], flags):
        assert cli.main(["generate", "--model", str(folder / "ckpt.pt"), *how, "--prompt", "ab",
                         "--max-new-tokens", "3", "--no-compile"]) == 0
        out = capsys.readouterr()
        assert "3 tokens" in out.err and "key_map" not in out.out


def test_the_tokenizer_is_the_named_one_and_must_fit(own_file, student_file, tmp_path):
    from tokenizers import Tokenizer, models

    path, _ = own_file
    assert isinstance(resolve(str(path), tokenizer="byte").tokenizer, ByteTokenizer)
    words = {"<|endoftext|>": 0, "hello": 1, "world": 2, "[UNK]": 3}
    Tokenizer(models.WordLevel(words, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    tokenizer = resolve(str(path), tokenizer=str(tmp_path / "tokenizer.json")).tokenizer
    assert isinstance(tokenizer, TokenizerFile) and tokenizer.vocab_size == 4 and tokenizer.stop_ids == [0]
    assert tokenizer.encode("hello") == [1] and tokenizer.chat_template is None
    with pytest.raises(ValueError, match="has 49152 tokens but .* embeds 257"):
        resolve(str(path), tokenizer="smollm2-135m")


def test_a_tokenizer_config_beside_the_file_gives_the_chat_template(own_file, tmp_path):
    """As Hugging Face saves a tokenizer: tokenizer.json, and tokenizer_config.json with the chat template and
    the end token; `chat` then takes the model (a file without one is refused, as a toy model is)."""
    import argparse

    from tokenizers import Tokenizer, models

    path, _ = own_file
    words = {"<|im_start|>": 0, "<|im_end|>": 1, "user": 2, "assistant": 3, "hi": 4, "[UNK]": 5}
    Tokenizer(models.WordLevel(words, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }} {{ m['content'] }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}{{ bos_token }}assistant {% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}}))
    args = argparse.Namespace(command="chat", model=str(path), tokenizer=str(tmp_path / "tokenizer.json"),
                              config=None)
    tokenizer = cli._model_source(args).tokenizer
    assert tokenizer.stop_ids == [1]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user hi<|im_end|><|im_start|>assistant "
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match="has no chat template"):
        cli._model_source(args)


def _one_line_error(argv, capsys, monkeypatch) -> str:
    monkeypatch.delenv("CS336_DEBUG", raising=False)
    assert cli.main([*argv, "--no-compile"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_each_mistake_is_one_line(own_file, student_file, tmp_path, capsys, monkeypatch):
    path, _ = own_file
    folder, student = student_file
    ckpt = str(folder / "ckpt.pt")
    gen = ["generate", "--prompt", "hi", "--model"]
    assert "no checkpoint file at" in _one_line_error([*gen, str(tmp_path / "gone.pt")], capsys, monkeypatch)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    assert "is not a readable PyTorch checkpoint" in _one_line_error([*gen, str(tmp_path / "junk.pt")], capsys,
                                                                      monkeypatch)
    assert "is a folder" in _one_line_error([*gen, str(folder)], capsys, monkeypatch)
    err = _one_line_error([*gen, ckpt, "--d-model", "32"], capsys, monkeypatch)
    assert "no config" in err and "missing: --vocab-size, --context-length, --num-layers, --num-heads, --d-ff" in err
    err = _one_line_error([*gen, ckpt, "--config", str(folder / "config.json"), "--d-ff", "40"], capsys, monkeypatch)
    assert "ckpt.pt does not match the config given (vocab_size=257, context_length=64, d_model=32" in err
    assert "d_ff=40)" in err and "(48, 32)" in err   # the student's w1 is 48 x 32
    assert "--config: no file at" in _one_line_error([*gen, ckpt, "--config", str(tmp_path / "c.json")], capsys,
                                                     monkeypatch)
    err = _one_line_error([*gen, str(path), "--config", str(folder / "config.json")], capsys, monkeypatch)
    assert "carries its own config" in err
    err = _one_line_error([*gen, "target", "--tokenizer", "byte"], capsys, monkeypatch)
    assert "--tokenizer applies to a checkpoint file" in err
    err = _one_line_error([*gen, str(path), "--tokenizer", "nope.json"], capsys, monkeypatch)
    assert "--tokenizer must be 'byte', a model name" in err
    small = StudentLM(Arch(), LAYOUTS["handout"], seed=0)          # a 97-token vocabulary: not bytes
    torch.save(small.state_dict(), tmp_path / "small.pt")
    err = _one_line_error([*gen, str(tmp_path / "small.pt"), "--config", str(folder / "config.json"),
                           "--vocab-size", "97"], capsys, monkeypatch)
    assert "does not name its tokenizer and its vocabulary (97 tokens)" in err and "pass --tokenizer" in err
    err = _one_line_error(["chat", "--model", str(path)], capsys, monkeypatch)   # refused before it loads
    assert "has no chat template" in err
    err = _one_line_error([*gen, "gpt-17"], capsys, monkeypatch)
    assert "unknown pretrained model 'gpt-17'" in err and "or a checkpoint file" in err


def test_serve_takes_a_checkpoint_file(own_file, monkeypatch):
    """`serve --model PATH` loads the file as chat and generate do (the server itself is not started here)."""
    pytest.importorskip("fastapi")
    import cs336_inference.serving.http as http

    path, model = own_file
    served = []
    monkeypatch.setattr(http, "run_server", lambda server, host, port, *a, **k: served.append(server))
    assert cli.main(["serve", "--model", str(path), "--port", "0", "--no-compile"]) == 0
    (server,) = served
    assert server.model_name == str(path) and server.context_length == model.config.context_length
    assert isinstance(server.tokenizer, ByteTokenizer)
