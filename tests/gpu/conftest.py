"""The GPU tests' warning filters: those of cupy and of torch's CUDA set-up are not ours.

Warnings are errors in this project's tests (pyproject's `filterwarnings = error`). These
entries take the ini form, whose module field is a regular expression matched against the
start of the warning's module name: `cupy(\\..*)?$` covers cupy and every submodule
(`cupy._environment`, which warns about CUDA paths). The same filter given as `pytest -W`
would not: pytest escapes a `-W` module field and anchors it at the end, so `-W
ignore::UserWarning:cupy` matches the module `cupy` only.
"""

from __future__ import annotations

import pytest

# (category, module regex)
IGNORED = [
    ("UserWarning", r"cupy(\..*)?$"),
    ("DeprecationWarning", r"cupy(\..*)?$"),
    ("FutureWarning", r"cupy(\..*)?$"),
    ("UserWarning", r"cupyx(\..*)?$"),
    ("UserWarning", r"torch\.cuda(\..*)?$"),
]


def pytest_configure(config: pytest.Config) -> None:
    for category, module in IGNORED:
        config.addinivalue_line("filterwarnings", f"ignore::{category}:{module}")
