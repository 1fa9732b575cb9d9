"""transformers' continuous batching on the engine (engine.integrations.transformers.continuous): greedy tokens of
``generate_batch`` equal static ``generate`` for every decoder family of tests/test_hf_models.py (windows, softcap,
sinks, GQA/MQA), with chunked prefills, prefix sharing and a manager whose requests join and are cancelled while it
runs; the engine's code computes every continuous-batching call, and nothing of it stays registered after."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("engine.integrations.transformers")

from transformers import AttentionInterface, ContinuousBatchingConfig, GenerationConfig  # noqa: E402

import engine.integrations.transformers.continuous as continuous  # noqa: E402
from engine.integrations.transformers import continuous_batching  # noqa: E402
from tests.test_hf_models import FAMILIES, VOCAB, build  # noqa: E402
from tests.trained import load_trained_model  # noqa: E402

pytestmark = pytest.mark.timeout(300)  # a continuous-batching loop that stalls fails the test, never hangs it

NEW = 10
GENERATION = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)


def prompts(lengths=(12, 5, 9, 17), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def static_greedy(model, inputs):
    return [model.generate(torch.tensor([p]), generation_config=GENERATION)[0, len(p):].tolist() for p in inputs]


def batching_config(**overrides):
    # small pages and a small token budget: prompts are prefilled in chunks, decodes and prefills share steps
    settings = dict(page_size=4, num_blocks=96, max_batch_tokens=16, auto_switch_to_flash=False)
    return ContinuousBatchingConfig(**{**settings, **overrides})


@pytest.fixture
def engine_calls(monkeypatch):
    """Counts of the engine's continuous-batching paths taken (decode steps in place, per-request calls)."""
    counts = {"batch": 0, "decode step": 0}
    batch, run = continuous.continuous_batch_attention, continuous.BatchPlan.run

    def counted_batch(*args, **kwargs):
        counts["batch"] += 1
        return batch(*args, **kwargs)

    def counted_run(self, *args, **kwargs):
        counts["decode step"] += self.decode is not None and self.decode.path == "native in place"
        return run(self, *args, **kwargs)

    monkeypatch.setattr(continuous, "continuous_batch_attention", counted_batch)
    monkeypatch.setattr(continuous.BatchPlan, "run", counted_run)
    return counts


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_batch_on_the_engine_gives_static_generates_tokens(family, engine_calls):
    model = build(family, "engine")
    inputs = prompts()
    want = static_greedy(model, inputs)
    with continuous_batching(model):
        out = model.generate_batch(inputs=inputs, generation_config=GENERATION,
                                   continuous_batching_config=batching_config())
    got = [out[f"req_{i}"].generated_tokens for i in range(len(inputs))]
    assert got == want
    layers = model.config.num_hidden_layers
    assert engine_calls["batch"] >= layers * NEW  # every layer of every step ran on the engine
    # decode steps in place through the paged kernel; softcap (Gemma 2): each request's own causal_attention
    assert (engine_calls["decode step"] > 0) == (family != "gemma2-softcap")
    assert model.config._attn_implementation == "engine"  # switched back


def test_nothing_stays_registered_after_the_block_and_other_calls_pass_through():
    before = {name: AttentionInterface._global_mapping[name] for name in continuous.CONTINUOUS_NAMES}
    model = build("llama-gqa", "sdpa")
    ids = torch.tensor([prompts()[0]])
    plain = model(ids).logits
    with continuous_batching():
        routed = AttentionInterface._global_mapping["sdpa"]
        assert routed is not before["sdpa"] and routed.engine_routes_from is before["sdpa"]
        with continuous_batching():  # nested: routed once
            assert AttentionInterface._global_mapping["sdpa"] is routed
        torch.testing.assert_close(model(ids).logits, plain, rtol=0, atol=0)  # not a continuous batch: sdpa's own
    assert {name: AttentionInterface._global_mapping[name] for name in continuous.CONTINUOUS_NAMES} == before


def test_overlapping_blocks_route_until_the_last_one_ends_and_leave_nothing_registered():
    # enter A, enter B, leave A, leave B (not nested): routing and the model's switch last until B ends
    registered = lambda: {name: AttentionInterface()[name] for name in continuous.CONTINUOUS_NAMES}  # noqa: E731
    before = registered()
    model = build("llama-gqa", "engine")
    a, b = continuous_batching(model), continuous_batching(model)
    a.__enter__()
    routed = registered()
    assert routed["sdpa"] is not before["sdpa"] and routed["sdpa"].engine_routes_from is before["sdpa"]
    b.__enter__()
    assert registered() == routed and model.config._attn_implementation != "engine"
    a.__exit__(None, None, None)
    assert registered() == routed and model.config._attn_implementation != "engine"  # B still runs
    b.__exit__(None, None, None)
    assert registered() == before and model.config._attn_implementation == "engine"
    with continuous_batching(model):  # and a later block routes again, from the library's own functions
        assert registered()["sdpa"].engine_routes_from is before["sdpa"]
    assert registered() == before


def test_each_forward_is_planned_once_and_its_layers_read_nothing_back_to_the_host(monkeypatch):
    # the first layer of a forward plans it (host reads of the offsets, the decode step's table); the other layers
    # run the plan: decode steps in place make no host read at all
    from tests.host_syncs import counted_host_syncs

    model = build("llama-gqa", "engine")
    plans, runs, syncs = [], [], []
    make, run = continuous.plan_batch, continuous.BatchPlan.run

    def counted_plan(*args, **kwargs):
        plans.append(make(*args, **kwargs))
        return plans[-1]

    def counted_run(self, *args, **kwargs):
        with counted_host_syncs() as counts:
            out = run(self, *args, **kwargs)
        runs.append(self)
        syncs.append((self.decode is not None and not self.requests, sum(counts.values())))
        return out

    monkeypatch.setattr(continuous, "plan_batch", counted_plan)
    monkeypatch.setattr(continuous.BatchPlan, "run", counted_run)
    inputs = prompts()
    want = static_greedy(model, inputs)
    with continuous_batching(model):
        out = model.generate_batch(inputs=inputs, generation_config=GENERATION,
                                   continuous_batching_config=batching_config())
    assert [out[f"req_{i}"].generated_tokens for i in range(len(inputs))] == want
    layers = model.config.num_hidden_layers
    assert len(runs) == layers * len(plans)  # one plan per forward, run by each of its layers
    decode_only = [count for only_decodes, count in syncs if only_decodes]
    assert decode_only and all(count == 0 for count in decode_only), syncs


def test_without_the_block_transformers_refuses_the_engine():
    model = build("llama-gqa", "engine")
    with pytest.raises(ValueError, match="not supported for continuous batching"):
        model.generate_batch(inputs=prompts()[:1], generation_config=GENERATION,
                             continuous_batching_config=batching_config())


def test_prefix_sharing_requests_equal_static_generate(engine_calls):
    # two requests with a common 16-token prefix (4 full pages): the second reuses the first's pages and runs
    # as a chunked prefill after them
    model = build("llama-gqa", "engine")
    shared = prompts((16,), seed=4)[0]
    inputs = [shared + [5, 6, 7], shared + [9, 10]]
    want = static_greedy(model, inputs)
    with continuous_batching(model):
        first = model.generate_batch(inputs=inputs[:1], generation_config=GENERATION,
                                     continuous_batching_config=batching_config(allow_block_sharing=True))
        assert first["req_0"].generated_tokens == want[0]
        manager = model.init_continuous_batching(generation_config=GENERATION,
                                                 continuous_batching_config=batching_config(allow_block_sharing=True))
        manager.start()
        try:
            ids = [manager.add_request(p, max_new_tokens=NEW) for p in inputs]
            results = {}
            for _ in range(200):
                result = manager.get_result(timeout=1.0)
                if result is not None and result.is_finished():
                    results[result.request_id] = result.generated_tokens
                if len(results) == len(ids):
                    break
        finally:
            manager.stop(block=True, timeout=30)
    assert [results[i] for i in ids] == want


def test_requests_join_and_are_cancelled_while_the_manager_runs():
    model = build("qwen2-sliding", "engine")
    inputs = prompts((12, 7, 20, 5))
    want = static_greedy(model, inputs)
    with continuous_batching(model):
        manager = model.init_continuous_batching(generation_config=GENERATION,
                                                 continuous_batching_config=batching_config())
        manager.start()
        try:
            first = manager.add_request(inputs[0], max_new_tokens=NEW)
            doomed = manager.add_request(inputs[2], max_new_tokens=200)
            manager.cancel_request(doomed)
            later = [manager.add_request(p, max_new_tokens=NEW) for p in (inputs[1], inputs[3])]
            results = {}
            for _ in range(200):
                result = manager.get_result(timeout=1.0)
                if result is not None and result.is_finished():
                    results[result.request_id] = result.generated_tokens
                if all(i in results for i in [first, *later]):
                    break
        finally:
            manager.stop(block=True, timeout=30)
    assert results[first] == want[0]
    assert [results[i] for i in later] == [want[1], want[3]]
    assert len(results.get(doomed, [])) < 200  # cancelled: it never ran to its 200 tokens


@pytest.mark.slow
def test_the_trained_smollm2_gives_static_generates_tokens_under_continuous_batching():
    model, tokenizer, _ = load_trained_model()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
             "The three primary colours are"]
    inputs = [tokenizer(text)["input_ids"] for text in texts]
    generation = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None,
                                  pad_token_id=tokenizer.eos_token_id)
    want = [model.generate(torch.tensor([p]), generation_config=generation)[0, len(p):].tolist() for p in inputs]
    with continuous_batching(model):
        out = model.generate_batch(inputs=inputs, generation_config=generation,
                                   continuous_batching_config=batching_config(page_size=16, num_blocks=64,
                                                                              max_batch_tokens=32))
    assert [out[f"req_{i}"].generated_tokens for i in range(len(inputs))] == want
    assert "Paris" in tokenizer.decode(want[0])  # trained weights: the model knows this


def packed_oracle(query, key, value, cu_q, cu_k, scale, window=None, sinks=None):
    """float64, request by request: query i of request r (its last keys) sees its keys j <= pos (and in the window)."""
    out = torch.zeros(query.shape[2], query.shape[1], value.shape[3], dtype=torch.float64)
    group = query.shape[1] // key.shape[1]
    for r in range(len(cu_q) - 1):
        t, s = cu_q[r + 1] - cu_q[r], cu_k[r + 1] - cu_k[r]
        for i in range(t):
            pos = s - t + i
            keys = [j for j in range(s) if j <= pos and (window is None or pos - j < window)]
            for h in range(query.shape[1]):
                k = key[0, h // group, [cu_k[r] + j for j in keys]].double()
                v = value[0, h // group, [cu_k[r] + j for j in keys]].double()
                scores = k @ query[0, h, cu_q[r] + i].double() * scale
                logits = scores if sinks is None else torch.cat([scores, sinks[h:h + 1].double()])
                out[cu_q[r] + i, h] = torch.softmax(logits, 0)[:len(keys)] @ v
    return out


@pytest.mark.parametrize("cu_q, cu_k", [([0, 1, 2, 3], [0, 9, 20, 23]),  # a decode step: one paged call
                                        ([0, 1, 6, 7, 8], [0, 10, 16, 30, 33]),  # decodes beside a prefill chunk
                                        ([0, 9, 16], [0, 9, 16]),  # two prefills
                                        ([0, 3, 4, 7], [0, 12, 15, 22])])  # chunks of 3 and a decode
@pytest.mark.parametrize("window, with_sinks", [(None, False), (4, True)])
def test_a_continuous_batch_layer_equals_the_per_request_oracle(cu_q, cu_k, window, with_sinks):
    g = torch.Generator().manual_seed(len(cu_q))
    query = torch.randn(1, 4, cu_q[-1] + 2, 16, generator=g)  # two padded rows past cu_q[-1]
    key = torch.randn(1, 2, cu_k[-1], 16, generator=g)
    value = torch.randn(1, 2, cu_k[-1], 16, generator=g)
    sinks = torch.randn(4, generator=g) if with_sinks else None
    kwargs = dict(cu_seq_lens_q=torch.tensor(cu_q), cu_seq_lens_k=torch.tensor(cu_k), read_index=[], s_aux=sinks)
    out, weights = continuous.continuous_batch_attention(None, query, key, value, None, scaling=0.25,
                                                         sliding_window=window, **kwargs)
    assert weights is None and out.shape == (1, cu_q[-1] + 2, 4, 16)
    want = packed_oracle(query, key, value, cu_q, cu_k, 0.25, window, sinks)
    torch.testing.assert_close(out[0, :cu_q[-1]].double(), want[:cu_q[-1]], rtol=1e-5, atol=1e-5)
    assert not bool(out[0, cu_q[-1]:].any())  # padding rows: 0


@pytest.mark.parametrize("mode", ["grad off", "inference"])
def test_offsets_written_in_place_between_calls_make_a_new_plan(mode):
    # a static buffer's offsets rewritten for the next step (version counter; an inference tensor by its values)
    from engine import causal_attention

    g = torch.Generator().manual_seed(4)
    query, key, value = torch.randn(1, 4, 2, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g), \
        torch.randn(1, 2, 12, 8, generator=g)
    context = torch.inference_mode() if mode == "inference" else torch.no_grad()
    with context:
        cu_q, cu_k = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
        for split in (5, 8):
            cu_k[1] = split  # in place: the same tensor object, other offsets
            kwargs = dict(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, read_index=[])
            out, _ = continuous.continuous_batch_attention(None, query, key, value, None, **kwargs)
            for r, (k0, k1) in enumerate(((0, split), (split, 12))):
                want = causal_attention(query[:, :, r:r + 1], key[:, :, k0:k1], value[:, :, k0:k1])
                torch.testing.assert_close(out[0, r], want[0, :, 0], rtol=1e-6, atol=1e-6)
