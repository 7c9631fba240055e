"""Kernels beside their torch references: CPU paths and Triton (CUDA) paths."""
