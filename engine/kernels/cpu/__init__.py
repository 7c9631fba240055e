"""CPU kernels and the per-machine choices between them."""
