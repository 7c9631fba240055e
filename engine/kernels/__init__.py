"""Kernels beside their torch reference: `cpu/` (C++ built on the running machine, choices
calibrated on it) and, on CUDA, Triton. Each has a torch reference it is tested against."""
