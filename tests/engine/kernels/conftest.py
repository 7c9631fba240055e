"""The Triton kernel tests run on a CUDA GPU when there is one, else in Triton's interpreter,
which tests/conftest.py switches on before anything imports Triton (`triton.jit` reads
TRITON_INTERPRET when a function is decorated, and triton.language decorates its helpers on
import)."""
