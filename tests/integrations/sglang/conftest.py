"""The SGLang tests run only where sglang (0.5.23) imports; its modules are imported once here."""

import warnings

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("sglang")

from .hostpools import import_sglang  # noqa: E402

import_sglang()
