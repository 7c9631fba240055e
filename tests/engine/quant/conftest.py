import pytest

from engine.kernels.cpu import quant_gemm


@pytest.fixture(scope="session", autouse=True)
def _quant_gemm_built():
    """Build (or load) the C++ kernel once, under the real cache dir, before any test points
    MINI_INFER_CACHE_DIR at a temporary one (which would compile it again there)."""
    quant_gemm.load()
