"""`bench llamacpp`: without llama-cpp-python it says how to install it and writes nothing; with it
(slow: the real model, a compile and llama.cpp) the quick run compares both engines on one GGUF."""

import importlib.util

import pytest

from cs336_inference.workshop.benchmarks import llamacpp

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.mark.skipif(HAVE_LLAMA_CPP, reason="llama-cpp-python is installed: the slow test runs the bench")
def test_without_llama_cpp_it_says_how_to_install_and_writes_nothing(capsys, git_tree_unchanged):
    assert "pip install" in llamacpp.llama_cpp_missing() and "[peer]" in llamacpp.llama_cpp_missing()
    assert llamacpp.BENCHMARK(quick=True) is None
    assert "bench llamacpp skipped: llama-cpp-python is not installed" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_LLAMA_CPP or llamacpp.real_model_missing(llamacpp.MODEL) is not None,
                    reason="needs llama-cpp-python (the [peer] extra) and SmolLM2's package")
def test_quick_run_compares_both_engines_on_the_same_file():
    result = llamacpp.BENCHMARK(quick=True)
    engines = {(r["engine"], r["threads"]) for r in result["rows"]}
    assert engines == {(e, t) for e in ("ours", "llama.cpp") for t in (1, 2)}
    assert all(r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and 0 < r["bytes_per_step"] for r in result["rows"])
    a = result["agreement"]
    assert a["ours_vs_llamacpp"] >= 0.9 * a["positions"]   # the same weights: the same next token nearly always
    # where llama.cpp's repacking crashes (AMX, ggml-org/llama.cpp#20824) it ran the weights as stored
    assert result["llama_cpp_repacking"] is llamacpp.repacking_works()


@pytest.mark.skipif(not HAVE_LLAMA_CPP or llamacpp.real_model_missing(llamacpp.MODEL) is not None,
                    reason="needs llama-cpp-python (the [peer] extra) and SmolLM2's package")
def test_loading_without_repacking_sets_only_that_model_parameter():
    import llama_cpp.llama as llama_module

    defaults = llama_module.llama_cpp.llama_model_default_params
    seen = []

    def recording():
        seen.append(defaults())
        return seen[-1]
    llama_module.llama_cpp.llama_model_default_params = recording
    try:
        llamacpp._llama(1, 32, repack=False)
        restored = llama_module.llama_cpp.llama_model_default_params
    finally:
        llama_module.llama_cpp.llama_model_default_params = defaults
    assert len(seen) == 1 and seen[0].use_extra_bufts is False
    assert restored is recording                                    # _llama put back what it found
