"""The modifier cases of ``run.py bench kernels`` time peers that compute the same thing as the engine."""

from __future__ import annotations

import pytest
import torch

from lab.bench.modifier_cases import alibi_case, relative_bias_case, sinks_case


@pytest.mark.parametrize("make", [sinks_case, alibi_case, relative_bias_case])
def test_every_implementation_of_a_modifier_case_gives_the_engines_output(make):
    case = make(96, 4, 16, flex=False)
    impls = case.build()
    outputs = {}
    for impl in impls:
        if impl.setup is not None:
            impl.setup()
        outputs[impl.label] = impl.run()
    assert {"sdpa dense bias", "engine:tiled"} <= set(outputs)
    engine = next(out for label, out in outputs.items() if label.startswith("engine ("))
    for label, out in outputs.items():
        torch.testing.assert_close(out, engine, rtol=1e-4, atol=1e-4, msg=label)
