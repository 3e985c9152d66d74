"""The offline corpus: deterministic bytes, a clean train/val split, batches, the recall probe."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from adapters import run_build_corpus, run_build_documents, run_load_corpus, run_make_recall_probe

from cs336_inference.data import get_batch

# sha256 of build_corpus(0). The grammar part depends only on the seed (random.Random is stable
# across Python versions) but pydoc_data.topics is CPython's own help text, which changes between
# minor versions, so the pin is per version. To regenerate after an intended corpus change:
#   python -c "import hashlib; from cs336_inference.data import build_corpus;
#              print(hashlib.sha256(build_corpus(0)).hexdigest())"
PINNED_SHA256 = {
    (3, 11): "a7dee0e5e903dac7a95358862822065dda89d43724ab75329df34e2f07a99ceb",
}
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def test_corpus_is_deterministic_and_pinned():
    corpus = run_build_corpus(0)
    assert isinstance(corpus, bytes) and len(corpus) >= 3_000_000, f"corpus is only {len(corpus)} bytes"
    # A fresh process (no in-memory cache) must build the very same bytes.
    code = f"import sys, hashlib; sys.path.insert(0, {SRC!r}); from cs336_inference.data import build_corpus; " \
           "print(hashlib.sha256(build_corpus(0)).hexdigest())"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert fresh == _sha(corpus), "build_corpus(0) differs between two processes"
    pinned = PINNED_SHA256.get(sys.version_info[:2])
    if pinned is not None:
        assert _sha(corpus) == pinned, "corpus bytes changed for seed 0; if intended, update PINNED_SHA256"


def test_seed_changes_the_grammar_not_the_pydoc_text():
    a, b = run_build_corpus(0), run_build_corpus(1)
    assert _sha(a) != _sha(b)
    assert b'The "if" statement' in a and b'The "if" statement' in b   # CPython's own English
    for marker in (b"Check: ", b"Once upon a time", b"sacks of"):    # the three grammar kinds
        assert marker in a


def test_every_ledger_check_repeats_an_earlier_fact():
    """The long-range structure is real: each 'Check: X's code is V.' restates an earlier 'X's code is V.'."""
    checked = 0
    for doc in run_build_documents(0)[:400]:
        if not doc.startswith("Ledger"):
            continue
        facts = {}
        for line in doc.split("\n"):
            if line.startswith("Check: "):
                name, value = line[len("Check: "):].split("'s code is ")
                assert facts[name] == value.rstrip("."), f"check {line!r} does not match the fact"
                checked += 1
            elif "'s code is " in line:
                name, value = line.split("'s code is ")
                facts[name] = value.rstrip(".")
    assert checked > 100


def test_split_is_fixed_and_disjoint():
    train, val = run_load_corpus("train"), run_load_corpus("val")
    assert train.dtype == torch.long and train.dim() == 1 and val.dim() == 1
    assert 0 <= int(train.min()) and int(train.max()) == 256 and int(val.max()) == 256
    assert val.numel() > 100_000 and train.numel() > 10 * val.numel()
    # Every token of the corpus lands in exactly one split (documents + one <|endoftext|> each).
    docs = run_build_documents(0)
    assert train.numel() + val.numel() == sum(len(d.encode()) + 1 for d in docs)
    # No validation text appears in the training text: sampled 200-byte windows of val documents.
    train_bytes = train[train < 256].to(torch.uint8).numpy().tobytes()
    g = torch.Generator().manual_seed(0)
    checked = 0
    for start in torch.randint(0, val.numel() - 200, (200,), generator=g).tolist():
        window = val[start:start + 200]
        if (window == 256).any():
            continue
        assert bytes(window.tolist()) not in train_bytes, f"validation bytes at {start} also occur in train"
        checked += 1
    assert checked >= 100
    assert torch.equal(run_load_corpus("val"), val), "the split must be the same on every call"


def test_load_corpus_returns_a_copy_and_rejects_bad_split():
    a = run_load_corpus("val")
    a[:10] = 0
    assert not torch.equal(run_load_corpus("val")[:10], a[:10])
    with pytest.raises(ValueError, match="split"):
        run_load_corpus("test")
    with pytest.raises(ValueError, match="seed"):
        run_load_corpus("train", seed=-1)


def test_get_batch_refuses_bad_sizes():   # its windows are graded (tests/graded/test_batch_sampler.py)
    with pytest.raises(ValueError, match="seq_len"):
        get_batch(torch.arange(1000), 4, 0)
    with pytest.raises(ValueError, match="tokens"):
        get_batch(torch.arange(10), 1, 10)
    x, y = get_batch(torch.arange(1000), 2, 8, device="cpu")
    assert x.device.type == y.device.type == "cpu"


@pytest.mark.parametrize("distance", [100, 250, 400])
def test_recall_probe_places_the_fact_at_the_distance(distance):
    probe = run_make_recall_probe(4, distance, seed=7)
    prompt = probe.prompt
    fact = f"{probe.key}'s code is {probe.answer}."
    assert prompt.count(fact) == 1 and prompt.endswith(f"Check: {probe.key}'s code is ")
    value_pos = prompt.index(fact) + len(fact) - len(probe.answer) - 1
    assert probe.distance == len(prompt) - value_pos
    assert distance - 40 <= probe.distance <= distance
    assert prompt.count("'s code is ") == 4 + 1  # 4 facts + the query
    assert run_make_recall_probe(4, distance, seed=7) == probe


def test_recall_probe_bad_inputs():
    with pytest.raises(ValueError, match="num_items"):
        run_make_recall_probe(0, 100)
    with pytest.raises(ValueError, match="distance"):
        run_make_recall_probe(8, 20)
