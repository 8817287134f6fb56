"""The SGLang tests run only where sglang (0.5.23) imports; its modules are imported once here."""

import os
import warnings

import pytest

# SGLang imports vLLM where it is installed, and vLLM picks its platform once per process:
# the CPU, as test_vllm.py asks, so that the vLLM tests collected after these find it.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("sglang")

from .hostpools import import_sglang  # noqa: E402

import_sglang()
