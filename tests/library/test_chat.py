"""Streaming generation and the chat session: the same tokens as `generate`, the KV cache reused across
turns (only new tokens prefilled) with answers equal to a fresh re-prefill, split UTF-8 held back,
and the `generate`/`chat` commands on a shipped toy model."""

import pytest
from adapters import get_tokenizer, make_chat_session, make_conversation_cache, run_generate
from chat_tokenizers import ChatMLBytes

from cs336_inference.generation import TextStream
from cs336_inference.model import checkpoints

pytestmark = pytest.mark.usefixtures("one_thread")


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
    computed = len(session.ids)            # the first turn's tokens whose K/V were computed
    second = "".join(session.send("And then?", max_new_tokens=30))
    turn = session.history[1]
    rendered = tok.encode(tok.apply_chat_template(session.messages[:-1]))   # the second turn's prompt
    # prefix caching finds every full block of the first turn: at most a block's worth is recomputed
    assert computed - 16 < turn.reused_tokens <= computed and turn.reused_tokens % 16 == 0
    assert turn.prompt_tokens == len(rendered) - turn.reused_tokens < 40 + 16
    # A fresh session given the same history re-prefills everything and must answer the same.
    fresh = make_chat_session(target, tok, max_seq_len=400)
    fresh.messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": first}]
    assert "".join(fresh.send("And then?", max_new_tokens=30)) == second
    assert fresh.history[0].reused_tokens == 0
    session.reset()
    assert session.ids == [] and session.messages == []
    with pytest.raises(ValueError, match="exceeds the cache"):
        list(session.send("x" * 390, max_new_tokens=30))


def test_chat_sessions_share_one_engine_and_stream_side_by_side(target):
    """Two conversations interleaved on one engine (one paged KV pool): each streams what `generate`
    gives for its prompt alone, and each second turn reuses its own first turn's blocks."""
    from cs336_inference.serving import Engine, RequestStreams

    tok = ChatMLBytes()
    streams = RequestStreams(Engine(target, block_size=16, num_blocks=64, max_num_seqs=4))
    a, b = (make_chat_session(target, tok, streams=streams) for _ in range(2))
    for turn, (qa, qb) in enumerate([("Once upon a time", "The cat"), ("What next?", "And the dog?")]):
        ga, gb = a.send(qa, max_new_tokens=20), b.send(qb, max_new_tokens=20)
        pieces = {"a": [], "b": []}
        for name, gen in [("a", ga), ("b", gb)] * 40:   # alternate: both requests run in the same steps
            piece = next(gen, None)
            if piece is not None:
                pieces[name].append(piece)
        for name, session in (("a", a), ("b", b)):
            prompt = tok.encode(tok.apply_chat_template(session.messages[:-1]))
            want = run_generate(target, [prompt], 20, stop_tokens=tok.stop_ids).tokens[0]
            assert "".join(pieces[name]) == tok.decode([t for t in want if t not in tok.stop_ids])
            if turn == 1:
                assert session.history[1].reused_tokens > 0
    assert streams.engine.stats()["kv_blocks_used"] == 0


def test_a_session_on_a_conversation_cache_answers_as_generate_and_reuses_every_cached_token(target):
    """The chat command's fast path: one contiguous cache kept between turns. Each turn answers what
    `generate` gives for the whole conversation from scratch, and prefills only the tokens after the
    longest prefix already cached (the previous turn's tokens, to the token, not to a block)."""
    tok = ChatMLBytes()
    conversation = make_conversation_cache(target, 400)
    session = make_chat_session(target, tok, max_seq_len=400, streams=conversation)
    for turn, text in enumerate(["Tell me a story.", "And then?"]):
        computed = list(session.ids)                       # the previous turn's tokens with K/V
        answer = "".join(session.send(text, max_new_tokens=30))
        prompt = tok.encode(tok.apply_chat_template(session.messages[:-1]))
        want = run_generate(target, [prompt], 30, stop_tokens=tok.stop_ids).tokens[0]
        assert answer == tok.decode([t for t in want if t not in tok.stop_ids])
        common = next((i for i, (a, b) in enumerate(zip(computed, prompt)) if a != b), min(len(computed), len(prompt)))
        stats = session.history[turn]
        assert stats.reused_tokens == min(common, len(prompt) - 1) and (turn == 0) == (stats.reused_tokens == 0)
        assert stats.prompt_tokens == len(prompt) - stats.reused_tokens
        assert conversation.tokens == session.ids and conversation.cache.length == len(session.ids)
    # An edited history (reset, then a new first message) rolls the cache back to the common prefix.
    session.reset()
    answer = "".join(session.send("Tell me a joke.", max_new_tokens=20))
    prompt = tok.encode(tok.apply_chat_template(session.messages[:-1]))
    want = run_generate(target, [prompt], 20, stop_tokens=tok.stop_ids).tokens[0]
    assert answer == tok.decode([t for t in want if t not in tok.stop_ids])
    assert session.history[-1].reused_tokens == len(tok.encode("[user] Tell me a "))   # up to "story" vs "joke"


def test_an_answer_cut_short_leaves_the_conversation_cache_consistent(target):
    from cs336_inference.generation import SamplingParams

    conversation = make_conversation_cache(target, 128)
    prompt = list(b"Once upon a time")
    stream = conversation.generate(prompt, SamplingParams(max_tokens=20))
    taken = [next(stream)[0][0] for _ in range(5)]
    stream.close()                                      # the user stopped reading after 5 tokens
    assert conversation.cache.length == len(conversation.tokens) and conversation.tokens[:len(prompt)] == prompt
    assert conversation.tokens[len(prompt):] == taken[:len(conversation.tokens) - len(prompt)]
    again = [t[0] for t, _ in conversation.generate(prompt, SamplingParams(max_tokens=5))]
    assert again == taken                               # the same prompt, the same greedy answer
    with pytest.raises(ValueError, match="max_seq_len"):
        make_chat_session(target, ChatMLBytes(), max_seq_len=256, streams=conversation)


def test_text_stream_holds_back_a_split_utf8_character():
    tok = get_tokenizer()
    stream = TextStream(tok)
    pieces = [stream.push(b) for b in "é!".encode()]         # é is two bytes
    assert pieces == ["", "é", "!"]


def test_generate_and_chat_commands_on_a_toy_model(capsys, monkeypatch):
    from cs336_inference.cli import main

    assert main(["generate", "--model", "target", "--prompt", "Once upon a time", "--max-new-tokens", "20",
                 "--no-compile"]) == 0
    out = capsys.readouterr()
    assert len(out.out.strip()) > 0 and "TTFT" in out.err and "tok/s" in out.err
    assert "target: fp32 weights" in out.err and "eager decode (--no-compile)" in out.err   # the banner says what runs
    lines = iter(["Hello there", "/reset", "Again", "/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--model", "target", "--max-new-tokens", "10", "--no-compile"]) == 2   # no chat template
    assert "target has no chat template" in capsys.readouterr().err
    monkeypatch.setattr("cs336_inference.model.load_tokenizer", lambda name: ChatMLBytes())   # give it one
    assert main(["chat", "--model", "target", "--max-new-tokens", "10", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert out.count("TTFT") == 2 and "reused from the KV cache" in out


def test_generate_compiles_before_the_clock_starts(capsys, monkeypatch):
    """`generate` runs its compiled step once on a throwaway token before it prefills the prompt and starts
    the clock, as `chat` does, so the compile does not count as decode time (the stats line is decode speed)."""
    from cs336_inference import cli

    first_calls = []

    def fake_compiled(model):
        def decode(token_ids, cache):
            first_calls.append(cache.length)
            return model(token_ids[:, None], cache=cache)[:, -1]
        return decode, "fake compiled decode"

    monkeypatch.setattr(cli, "compiled_decode_step", fake_compiled)
    monkeypatch.setattr("cs336_inference.workshop.startup.SHORT_ANSWER_TOKENS", 5)   # 5 tokens: not "a short answer"
    assert cli.main(["generate", "--model", "target", "--prompt", "Once upon a time", "--max-new-tokens", "5"]) == 0
    err = capsys.readouterr().err
    assert "fake compiled decode: compiling... done (" in err and "5 tokens" in err
    assert first_calls[0] == 1 and len(first_calls) == 1 + 4   # the warm-up's step on one token, then the answer's


def test_precision_chooses_the_weights_and_the_banner_says_so(capsys):
    from cs336_inference.workshop.fast_path import load_for_inference

    model, _, banner = load_for_inference("target", precision="int8")
    assert banner.startswith("target: int8 weights") and "CPU tuning" in banner
    assert "int8pack" in model.describe()
    with pytest.raises(ValueError, match="int4-exact"):
        load_for_inference("target", precision="int4-exact")
    from cs336_inference.cli import main

    assert main(["info", "--model", "target", "--precision", "int8"]) == 0
    assert "layers.*.ffn.w2 (x4): int8pack per channel" in capsys.readouterr().out
    with pytest.raises(ValueError, match="precision must be one of"):
        load_for_inference("target", precision="int3")


@pytest.mark.slow
def test_the_chat_command_compiles_its_decode_step_in_the_background_and_answers_as_eager(capsys, monkeypatch):
    """`chat` by default compiles the decode step in the background (answering eagerly until it is ready,
    `startup.BackgroundCompile`) and then decodes with it: the same greedy answers as --no-compile, turn
    after turn."""
    from cs336_inference.cli import main

    answers = {}
    monkeypatch.setattr("cs336_inference.model.load_tokenizer", lambda name: ChatMLBytes())   # a chat template
    for flags in ([], ["--no-compile"]):
        lines = iter(["Hello there", "And then?", "/quit"])
        monkeypatch.setattr("builtins.input", lambda prompt="", lines=lines: next(lines))
        assert main(["chat", "--model", "target", "--max-new-tokens", "12", *flags]) == 0
        out = capsys.readouterr()
        answers[bool(flags)] = [line for line in out.out.splitlines() if "model>" in line]
        assert ("compiling in the background" in out.err) != bool(flags) and out.out.count("TTFT") == 2
    assert answers[False] == answers[True] and len(answers[True]) == 2


def test_compiling_first_hides_only_inductors_remark_on_mixed_low_precision(capsys, recwarn):
    """The warm-up's "compiling... done (N s)" line stays whole: inductor's note that a kernel mixes fp16
    scales with bf16 activations is dropped, any other warning still reaches the user."""
    import warnings

    from cs336_inference import cli

    def warm_up():
        warnings.warn("bf16 and fp16 are mixed in the scheduler node.", UserWarning, stacklevel=1)
        warnings.warn("the cache folder is read-only", UserWarning, stacklevel=1)

    cli._compile_first("compiled decode", decode=object(), warm_up=warm_up)
    assert [str(w.message) for w in recwarn] == ["the cache folder is read-only"]
    assert "compiled decode: compiling... done (" in capsys.readouterr().err
