"""Held-out English for the real model: disjoint calibration/eval splits of CPython's docs, and the
bytes each token stands for (so losses are comparable in bits per byte)."""

import pytest
from adapters import get_model_tokenizer, get_tokenizer, run_bytes_per_token, run_pydoc_documents
from smollm2_reference import requires_smollm2


def test_splits_are_disjoint_and_deterministic():
    calib, held_out = run_pydoc_documents("calibration"), run_pydoc_documents("eval")
    assert calib and held_out and not set(calib) & set(held_out)
    assert run_pydoc_documents("eval") == held_out
    with pytest.raises(ValueError, match="split"):
        run_pydoc_documents("train")


def test_bytes_per_token_of_the_byte_tokenizer():
    tok = get_tokenizer()
    nbytes = run_bytes_per_token(tok)
    assert nbytes[:256].tolist() == [1] * 256 and int(nbytes[tok.eot_id]) == len("<|endoftext|>")


@requires_smollm2
def test_bytes_per_token_of_the_bpe_add_up_to_the_text():
    tok = get_model_tokenizer("smollm2-135m")
    nbytes = run_bytes_per_token(tok)
    text = run_pydoc_documents("eval")[0][:2000]
    assert int(nbytes[tok.encode(text)].sum()) == len(text.encode("utf-8"))


def test_docstring_paragraphs_are_the_standard_librarys_own_prose():
    """Each paragraph is copied whole from a docstring of a top-level standard-library module (found in
    the sources once their whitespace is collapsed), is plain prose, and is none of the help paragraphs."""
    import sysconfig
    from pathlib import Path

    from cs336_inference.data.real_text import docstring_paragraphs, prose_paragraphs

    paragraphs = docstring_paragraphs()
    assert len(paragraphs) > 100 and paragraphs == sorted(set(paragraphs)) and docstring_paragraphs() == paragraphs
    sources = " ".join(" ".join(path.read_text(encoding="utf-8", errors="ignore").split())
                       for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))
    help_paragraphs = set(prose_paragraphs())
    for par in paragraphs:
        assert 250 <= len(par) <= 700 and par == " ".join(par.split()), par
        assert not any(mark in par for mark in (">>>", "::", "`", "=", "\\")), par
        assert par in sources and par not in help_paragraphs, par
