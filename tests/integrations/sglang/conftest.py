"""The SGLang tests run only where sglang (0.5.23) imports; its modules are imported once here,
and the radix-cache kit's fixture."""

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

from .radix import kit_session  # noqa: E402 (SGLang imports only after import_sglang)


@pytest.fixture
def kit():
    """The steps of SGLang's radix-cache kit, on the CPU (radix.py)."""
    with kit_session() as made:
        yield made
