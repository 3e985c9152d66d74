"""Python wrappers of our C++ kernels (`../csrc/`), compiled once per machine on first use."""
