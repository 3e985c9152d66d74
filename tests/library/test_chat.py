"""Streaming generation and the chat session: the same tokens as `generate`, the KV cache reused across
turns (only new tokens prefilled) with answers equal to a fresh re-prefill, split UTF-8 held back,
and the `generate`/`chat` commands on a shipped toy model."""

import pytest
from adapters import get_tokenizer, make_chat_session, run_generate

from cs336_inference.generation import TextStream
from cs336_inference.model import checkpoints

pytestmark = pytest.mark.usefixtures("one_thread")


class ChatMLBytes:
    """A byte tokenizer with a ChatML-style template written here (the session must use it as given);
    the toy model's one special token, <|endoftext|>, ends a message."""

    chat_template = "test"

    def __init__(self):
        self.inner = get_tokenizer()
        self.stop_ids = [self.inner.eot_id]

    def encode(self, text):
        return self.inner.encode(text)

    def decode(self, ids):
        return self.inner.decode(ids)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"[{m['role']}] {m['content']}<|endoftext|>\n" for m in messages)
        return text + ("[assistant] " if add_generation_prompt else "")


@pytest.fixture(scope="module")
def target():
    return checkpoints.load_pretrained("target")


def test_streamed_answer_is_what_generate_produces(target):
    tok = ChatMLBytes()
    session = make_chat_session(target, tok, max_seq_len=256)
    streamed = "".join(session.send("Once upon a time", max_new_tokens=40))
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Once upon a time"}]))
    reference = run_generate(target, [prompt], 40, stop_tokens=tok.stop_ids).tokens[0]
    assert streamed == tok.decode([t for t in reference if t not in tok.stop_ids])
    turn = session.history[0]
    assert turn.prompt_tokens == len(prompt) and turn.reused_tokens == 0 and turn.generated_tokens == len(reference)


def test_second_turn_prefills_only_new_tokens_and_matches_a_fresh_session(target):
    tok = ChatMLBytes()
    session = make_chat_session(target, tok, max_seq_len=400)
    first = "".join(session.send("Tell me a story.", max_new_tokens=30))
    cached = session.cache.length
    second = "".join(session.send("And then?", max_new_tokens=30))
    turn = session.history[1]
    rendered = tok.encode(tok.apply_chat_template(session.messages[:-1]))   # the second turn's prompt
    assert turn.reused_tokens == cached > 0 and turn.prompt_tokens == len(rendered) - cached < 40
    # A fresh session given the same history re-prefills everything and must answer the same.
    fresh = make_chat_session(target, tok, max_seq_len=400)
    fresh.messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": first}]
    assert "".join(fresh.send("And then?", max_new_tokens=30)) == second
    assert fresh.history[0].reused_tokens == 0
    session.reset()
    assert session.cache.length == 0 and session.messages == []
    with pytest.raises(ValueError, match="exceeds the cache"):
        list(session.send("x" * 390, max_new_tokens=30))


def test_text_stream_holds_back_a_split_utf8_character():
    tok = get_tokenizer()
    stream = TextStream(tok)
    pieces = [stream.push(b) for b in "é!".encode()]         # é is two bytes
    assert pieces == ["", "é", "!"]


def test_generate_and_chat_commands_on_a_toy_model(capsys, monkeypatch):
    from cs336_inference.cli import main

    assert main(["generate", "--model", "target", "--prompt", "Once upon a time", "--max-new-tokens", "20"]) == 0
    out = capsys.readouterr()
    assert len(out.out.strip()) > 0 and "TTFT" in out.err and "tok/s" in out.err
    lines = iter(["Hello there", "/reset", "Again", "/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--model", "target", "--max-new-tokens", "10"]) == 0
    out = capsys.readouterr().out
    assert out.count("TTFT") == 2 and "reused from the KV cache" in out
