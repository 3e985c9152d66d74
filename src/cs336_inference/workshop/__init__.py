"""The performance workshop: everything that makes the teaching core fast on a real machine.

The teaching core (model/, generation/, serving/, ...) is plain PyTorch and never imports this package;
the CLI's fast commands and the benchmarks do:

    openmp.py       OpenMP's wait policy (applied by the CLI's entry point and the benchmarks)
    cpu_tuning.py   opt-in CPU transforms of a model (thread counts under contention, few-row matmuls)
    huge_pages.py   streamed weights moved onto 2 MB pages
    fast_path.py    the model chat/generate/serve run: weights, kernels, threads, compile
    startup.py      how the fast path starts quickly: cache folders, background compile, packed weights
    kernels/        Python wrappers of our C++ kernels (csrc/): decode attention, int4 and dense few-row matmuls
    peers/          the Hugging Face / llama.cpp peers the decode benchmarks compare with
    benchmarks/     one module per `python -m cs336_inference bench NAME`
"""
