"""tests/gpu/conftest.py's filters (no GPU needed): cupy's submodules may warn, we may not."""

import warnings

import pytest


def warn_from(module: str, category: type[Warning] = UserWarning) -> None:
    """A warning raised by code whose module is `module` (as if imported under that name)."""
    code = compile(f"import warnings\nwarnings.warn('from {module}', {category.__name__})",
                   f"<{module}>", "exec")
    exec(code, {"__name__": module})


@pytest.mark.parametrize("module", ["cupy", "cupy._environment", "cupy.cuda.compiler",
                                    "cupyx.scipy", "torch.cuda", "torch.cuda.memory"])
def test_warnings_from_cupy_and_torch_cuda_and_their_submodules_are_ignored(module):
    warn_from(module)  # `filterwarnings = error` would fail this test, were it not ignored


@pytest.mark.parametrize("module", ["lmcache_mp.cuda", "cupy_lookalike", "torch"])
def test_warnings_from_elsewhere_are_still_errors(module):
    with pytest.raises(UserWarning, match=f"from {module}"):
        warn_from(module)


def test_a_minus_w_filter_would_not_have_covered_submodules():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=UserWarning, module=r"cupy\Z")  # -W's form
        warn_from("cupy")
        with pytest.raises(UserWarning):
            warn_from("cupy._environment")
