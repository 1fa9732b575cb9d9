"""``run.py serve`` (engine/serving/server.py, openai_api.py): the real server (uvicorn on a thread, a free loopback
port) over transformers' continuous batching on the engine, driven with httpx. A tiny random-weight Llama and a
word-level tokenizer built offline stand in for a model; greedy answers (temperature 0) are checked against static
``generate`` of a second copy of the model, alone; stop strings, bad requests and clients that leave are checked
for what the client sees and for what the manager still holds (``/health`` and the manager's own scheduler)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from engine.serving import manager_internals as internals  # noqa: E402
from engine.serving import openai_api as api  # noqa: E402
from engine.serving.model import load_model  # noqa: E402
from engine.serving.server import batching_config, create_app, running  # noqa: E402
from tests.trained import load_trained_model  # noqa: E402

pytestmark = pytest.mark.timeout(120)  # no test may hang: every wait below has its own, shorter, timeout

VOCAB, EOS, CONTEXT = 128, 2, 1024
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "system", "user", "assistant"]
WORDS = SPECIALS + [f"w{i}" for i in range(len(SPECIALS), VOCAB)]  # token i <-> word "w{i}"; text joins with " "
CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<s> assistant {% endif %}")
ROOT = Path(__file__).resolve().parents[1]


def save_tiny_model(folder: Path) -> None:
    """A 2-layer Llama (GQA, random weights far apart: greedy ids are robust) and a word-level tokenizer with a
    chat template, saved as a transformers model directory; nothing is downloaded."""
    model_words = tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>")
    backend = tokenizers.Tokenizer(model_words)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                     unk_token="<unk>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                                      initializer_range=0.2, tie_word_embeddings=False, eos_token_id=EOS,
                                      bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(folder)
    return folder


class Oracle:
    """A second copy of the model, outside any server: static greedy ``generate``, one prompt at a time."""

    def __init__(self, folder: Path) -> None:
        self.model, self.tokenizer, _ = load_model(str(folder))

    def __call__(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
        """``(tokens, text)`` of greedy decoding, up to and with EOS."""
        config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=EOS,
                                               pad_token_id=0)
        out = self.model.generate(torch.tensor([prompt_ids]), generation_config=config)
        tokens = out[0, len(prompt_ids):].tolist()
        return tokens, self.decode(tokens)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def oracle(tiny_dir) -> Oracle:
    return Oracle(tiny_dir)


class Server:
    def __init__(self, url: str, app) -> None:
        self.url, self.app = url, app
        self.client = httpx.Client(base_url=url, timeout=30)
        self.served = app.state.served

    def post(self, path: str, **body) -> httpx.Response:
        return self.client.post(path, json=body)

    def stream(self, path: str, **body) -> list[dict]:
        """The data of every event, in order (``[DONE]`` as the string)."""
        with self.client.stream("POST", path, json={**body, "stream": True}) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            return [_event(line) for line in response.iter_lines() if line]

    def idle(self, timeout: float = 15.0) -> dict:
        """Waits until the server holds no open request and the manager none active or waiting: ``/health``."""
        deadline = time.monotonic() + timeout
        while True:
            health = self.client.get("/health").json()
            handlers = self.served.manager.output_router.result_handlers  # none left behind by a cancelled request
            if all(n == 0 for n in health["requests"].values()) and not handlers:
                return health
            assert time.monotonic() < deadline, f"requests left over: {health}"
            time.sleep(0.05)


def _event(line: str):
    assert line.startswith("data: "), line
    data = line.removeprefix("data: ")
    return data if data == "[DONE]" else json.loads(data)


@pytest.fixture(scope="module")
def server(tiny_dir):
    model, tokenizer, name = load_model(str(tiny_dir))
    app = create_app(model, tokenizer, name, batching_config(cache_tokens=8192, max_batch_tokens=128, page_size=16))
    with running(app) as url:
        yield Server(url, app)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 24, (count,), generator=g)
    return [torch.randint(len(SPECIALS), VOCAB, (int(n),), generator=g).tolist() for n in lengths]


def streamed_text(events: list, chat: bool = False) -> str:
    key = (lambda c: c["delta"].get("content", "")) if chat else (lambda c: c["text"])
    return "".join(key(c) for e in events if isinstance(e, dict) for c in e["choices"])


def test_the_managers_internals_the_server_reads_are_there(server):
    # engine.serving.manager_internals reads what transformers has no public way to give: if a release moves one of
    # these, this names it (instead of a server that leaks handlers or reports no requests)
    manager = server.served.manager
    assert isinstance(manager.output_router.result_handlers, dict), "manager.output_router.result_handlers"
    assert callable(manager.get_result), "manager.get_result(timeout=...)"
    deadline = time.monotonic() + 60  # the manager's thread makes its processor as it starts (later under load)
    while manager.batch_processor is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert manager.batch_processor is not None, "manager.batch_processor (none 60 s after the server started)"
    scheduler = manager.batch_processor.scheduler
    assert hasattr(scheduler, "active_requests") and hasattr(scheduler, "waiting_requests"), "scheduler's queues"
    assert hasattr(manager.background_thread_status, "fatal_error"), "manager.background_thread_status.fatal_error"
    assert internals.request_counts(manager) == (0, 0) and not internals.failed(manager)
    internals.drop_result_handler(manager, "no such request")  # forgetting an unknown id is a no-op
    internals.drain_unread_results(manager)


def test_models_lists_the_served_model(server):
    body = server.client.get("/v1/models").json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [server.served.name]


@pytest.mark.parametrize("as_text", [False, True], ids=["token ids", "text"])
def test_greedy_completion_equals_static_generate(server, oracle, as_text):
    prompt = prompts(1, seed=1)[0]
    tokens, text = oracle(prompt, 20)
    sent = " ".join(WORDS[i] for i in prompt) if as_text else prompt
    body = server.post("/v1/completions", model=server.served.name, prompt=sent, max_tokens=20, temperature=0).json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == text
    assert body["choices"][0]["finish_reason"] == ("stop" if tokens[-1] == EOS else "length")
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                             "total_tokens": len(prompt) + len(tokens)}


def test_streamed_chunks_reassemble_the_greedy_text(server, oracle):
    prompt = prompts(1, seed=2)[0]
    tokens, text = oracle(prompt, 24)
    events = server.stream("/v1/completions", prompt=prompt, max_tokens=24, temperature=0,
                           stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    assert streamed_text(events) == text == server.post("/v1/completions", prompt=prompt, max_tokens=24,
                                                        temperature=0).json()["choices"][0]["text"]
    assert len(events) > 4  # token by token, not one chunk
    finish, usage = events[-3], events[-2]
    assert finish["choices"][0]["finish_reason"] == ("stop" if tokens[-1] == EOS else "length")
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(tokens)


def test_chat_completion_runs_the_chat_template(server, oracle):
    messages = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": [{"type": "text", "text": "w11"}]}]
    prompt = [1, 4, 9, 10, 1, 5, 11, 1, 6]  # <s> system w9 w10 <s> user w11 <s> assistant
    tokens, text = oracle(prompt, 16)
    body = server.post("/v1/chat/completions", messages=messages, max_tokens=16, temperature=0).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["usage"]["prompt_tokens"] == len(prompt) and body["usage"]["completion_tokens"] == len(tokens)
    events = server.stream("/v1/chat/completions", messages=messages, max_completion_tokens=16, temperature=0)
    assert events[0]["object"] == "chat.completion.chunk" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert streamed_text(events, chat=True) == text


def test_concurrent_requests_each_equal_their_greedy_result_alone(server, oracle, monkeypatch):
    inputs = prompts(8, seed=3)
    lengths = [12, 40, 7, 25, 33, 18, 40, 9]
    want = [oracle(p, n)[1] for p, n in zip(inputs, lengths)]
    open_at_admission = []
    add_request = server.served.manager.add_request

    def counted(*args, **kwargs):
        open_at_admission.append(len(server.served.open))
        return add_request(*args, **kwargs)

    monkeypatch.setattr(server.served.manager, "add_request", counted)
    start = threading.Barrier(10, timeout=30)

    def greedy(i: int) -> str:
        start.wait()
        if i % 2:  # half of them streamed
            return streamed_text(server.stream("/v1/completions", prompt=inputs[i], max_tokens=lengths[i],
                                               temperature=0))
        body = server.post("/v1/completions", prompt=inputs[i], max_tokens=lengths[i], temperature=0)
        return body.json()["choices"][0]["text"]

    def sampled(_: int) -> str:  # sampled requests in the same batches: greedy ones must not notice them
        start.wait()
        return server.post("/v1/completions", prompt=inputs[0], max_tokens=30, temperature=1.0,
                           top_p=0.9).json()["choices"][0]["text"]

    with ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(greedy, i) for i in range(8)] + [pool.submit(sampled, i) for i in range(2)]
        results = [f.result(timeout=60) for f in futures]
    assert results[:8] == want
    assert all(word in WORDS for text in results[8:] for word in text.split())
    assert max(open_at_admission) >= 2  # they did run together
    server.idle()


def test_sampling_draws_from_the_distribution(server, oracle):
    prompt = prompts(1, seed=4)[0]
    _, greedy = oracle(prompt, 40)
    drawn = [server.post("/v1/completions", prompt=prompt, max_tokens=40, temperature=2.0).json()["choices"][0]["text"]
             for _ in range(2)]
    assert drawn[0] != greedy or drawn[1] != greedy  # 80 draws at temperature 2, all equal to the argmax: no


BAD_REQUESTS = [  # (body, status, what the message or param names)
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "valid dictionary"),
    (b'{"max_tokens": 5}', 400, "prompt"),  # missing field
    (b'{"prompt": "w9", "max_tokens": "5"}', 400, "max_tokens"),  # wrong type
    (b'{"prompt": "w9", "stream": 1}', 400, "stream"),
    (b'{"prompt": "w9", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "w9", "temperature": 2.5}', 400, "temperature"),
    (b'{"prompt": "w9", "temperature": NaN}', 400, "finite number"),  # not "should be <= 2"
    (b'{"prompt": "w9", "top_p": NaN}', 400, "finite number"),
    (b'{"prompt": "w9", "model": "gpt-4"}', 404, "model"),
    (b'{"prompt": "w9", "temperature": 0.7, "seed": 1}', 400, "seed"),  # sampled + seed: refused, not ignored
    (b'{"prompt": "w9", "n": 2}', 400, "n=2"),
    (b'{"prompt": "w9", "presence_penalty": 0.5}', 400, "presence_penalty"),
    (b'{"prompt": "w9", "ignore_eos": 1}', 400, "ignore_eos"),  # strict: a bool
    (b'{"prompt": "w9", "stop": ["a", "b", "c", "d", "e"]}', 400, "stop"),
    (b'{"prompt": [9, 999]}', 400, "prompt"),  # a token id outside the vocabulary
    (b'{"prompt": []}', 400, "prompt"),
    (b'{"prompt": "w9", "max_tokens": 1024}', 400, "max_tokens"),  # 1 + 1024 tokens > the context (1024)
    (b'{"messages": []}', 400, "messages"),
    (b'{"messages": [{"role": "user"}]}', 400, "content"),
]


@pytest.mark.parametrize("raw, status, named", BAD_REQUESTS, ids=[b.decode() for b, _, _ in BAD_REQUESTS])
def test_a_bad_request_is_an_openai_error_and_the_server_lives_on(server, raw, status, named):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    response = server.client.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert named in f"{error['message']} {error['param']}"
    assert server.client.get("/v1/models").status_code == 200
    assert server.post("/v1/completions", prompt=[9, 10], max_tokens=2, temperature=0).status_code == 200


def test_seed_is_accepted_with_greedy_and_a_missing_route_is_a_404(server):
    assert server.post("/v1/completions", prompt=[9], max_tokens=2, temperature=0, seed=7).status_code == 200
    response = server.client.get("/v1/nothing")
    assert response.status_code == 404 and "error" in response.json()


def test_ignore_eos_generates_max_tokens_past_eos(server, oracle):
    # the first of the fixed prompts whose greedy continuation meets EOS early; with ignore_eos (vLLM's and
    # llama-server's field, which the serving bench sends) the request runs on to max_tokens, past it
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=40, eos_token_id=-1, pad_token_id=0)
    for prompt in prompts(60, seed=11):
        with torch.no_grad():
            past = oracle.model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()
        if EOS in past[:30]:
            break
    else:
        pytest.fail("no fixed prompt meets EOS within 30 greedy tokens")
    stops_at = past.index(EOS) + 1
    plain = server.post("/v1/completions", prompt=prompt, max_tokens=40, temperature=0).json()
    assert plain["usage"]["completion_tokens"] == stops_at and plain["choices"][0]["finish_reason"] == "stop"
    for stream in (False, True):
        body = dict(prompt=prompt, max_tokens=40, temperature=0, ignore_eos=True)
        if stream:
            events = server.stream("/v1/completions", **body, stream_options={"include_usage": True})
            text, usage, finish = streamed_text(events), events[-2]["usage"], events[-3]["choices"][0]["finish_reason"]
        else:
            whole = server.post("/v1/completions", **body).json()
            text, usage, finish = whole["choices"][0]["text"], whole["usage"], whole["choices"][0]["finish_reason"]
        assert usage["completion_tokens"] == 40 and finish == "length"
        assert text == oracle.decode(past)
    server.idle()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_cuts_the_text_and_ends_the_request(server, oracle, stream):
    prompt = prompts(1, seed=5)[0]
    tokens, text = oracle(prompt, 30)
    words = text.split()
    assert len(words) > 8
    stop = f"{words[5][1:]} {words[6][:2]}"  # spans two tokens: its first part must be held back, then dropped
    want = text[:text.find(stop)]
    completing = next(k for k in range(1, len(tokens) + 1) if stop in oracle.decode(tokens[:k]))
    request = dict(prompt=prompt, max_tokens=200, temperature=0, stop=[stop, "never seen"])
    if stream:
        events = server.stream("/v1/completions", **request)
        got, finish = streamed_text(events), events[-2]["choices"][0]["finish_reason"]
    else:
        body = server.post("/v1/completions", **request).json()
        got, finish = body["choices"][0]["text"], body["choices"][0]["finish_reason"]
        assert body["usage"]["completion_tokens"] == completing  # up to the token that completed the stop
    assert (got, finish) == (want, "stop")
    server.idle()  # cancelled in the manager, not run on to 200 tokens


LONG = prompts(1, seed=11)[0]  # greedy runs 545 tokens before EOS: seconds, where a cancel takes milliseconds


def test_a_client_gone_mid_stream_has_its_request_cancelled(server, monkeypatch):
    cancelled = []
    cancel = server.served.manager.cancel_request
    monkeypatch.setattr(server.served.manager, "cancel_request", lambda rid: (cancelled.append(rid), cancel(rid)))
    body = {"prompt": LONG, "max_tokens": 900, "temperature": 0, "stream": True}
    with server.client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        first = [_event(next(line for line in lines if line)) for _ in range(3)]  # three chunks, then leave
    server.idle()
    assert cancelled == [first[0]["id"]]  # cancelled (a request that finished in the manager is never cancelled)
    assert server.post("/v1/completions", prompt=[9, 10], max_tokens=3, temperature=0).status_code == 200
    assert server.served.manager.output_router.output_queue.empty()  # the cancelled step's token: drained


def test_a_client_gone_before_a_whole_response_has_its_request_cancelled(server, monkeypatch):
    cancelled = []
    cancel = server.served.manager.cancel_request
    monkeypatch.setattr(server.served.manager, "cancel_request", lambda rid: (cancelled.append(rid), cancel(rid)))
    with pytest.raises(httpx.ReadTimeout):
        server.client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 900, "temperature": 0}, timeout=0.5)
    server.idle()
    assert len(cancelled) == 1 and cancelled[0].startswith("cmpl-")


class _Letters:
    """A stand-in tokenizer whose token i is the i-th character of ``text`` (U+FFFD for an unfinished one)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.text[i] for i in token_ids)


@pytest.mark.parametrize("text, stops, sent, final_text", [
    ("Hi\n\nBye", ["\n\n"], ["H", "i", "", "", "", "", ""], "Hi"),  # "\n" held, then the stop: cut before it
    ("a\nb", ["\n\n"], ["a", "", "\nb"], "a\nb"),  # held "\n" released once it cannot begin the stop
    ("abcd", [], ["a", "b", "c", "d"], "abcd"),  # no stop: each token's text at once
    ("xyzw", ["yq", "zw"], ["x", "", "y", ""], "xy"),  # two stops: "y" held for one, "z" for the other, which hits
    ("é\ufffd", [], ["é", ""], "é"),  # an unfinished character waits
])
def test_text_stream_holds_back_what_may_begin_a_stop_and_cuts_at_it(text, stops, sent, final_text):
    stream = api.TextStream(_Letters(text), stops)
    deltas = [stream.update(list(range(i + 1))) for i in range(len(text))]
    assert deltas == sent
    assert "".join(deltas) == final_text == stream.sent.rstrip("\ufffd")
    assert stream.stopped == any(s in text for s in stops)


def test_text_stream_final_update_releases_the_held_tail():
    stream = api.TextStream(_Letters("ab\n"), ["\n\n"])
    assert [stream.update([0]), stream.update([0, 1]), stream.update([0, 1, 2])] == ["a", "b", ""]
    assert stream.update([0, 1, 2], final=True) == "\n" and not stream.stopped


@pytest.mark.parametrize("request_body, kwargs", [
    ({"temperature": 0}, api.GREEDY),  # greedy: top-k 1 leaves the argmax alone to draw
    ({"temperature": 0, "top_p": 0.3, "seed": 3}, api.GREEDY),
    ({"temperature": 1e-9}, api.GREEDY),  # below 1e-5: the limit (logits / temperature would overflow)
    ({"temperature": 0.7, "top_p": 0.9}, {"temperature": 0.7, "top_k": api.TOP_K_OFF, "top_p": 0.9}),
    ({"temperature": 1.0, "top_k": 5}, {"temperature": 1.0, "top_k": 5, "top_p": 1.0}),
    ({"temperature": 1.0, "top_k": -1}, {"temperature": 1.0, "top_k": api.TOP_K_OFF, "top_p": 1.0}),
])
def test_sampling_maps_onto_the_managers_per_request_processors(request_body, kwargs):
    assert api.CompletionRequest(prompt="w9", **request_body).sampling() == kwargs


@pytest.mark.slow
def test_run_py_serve_prints_its_url_answers_and_stops_on_ctrl_c(tiny_dir):
    process = subprocess.Popen([sys.executable, "run.py", "serve", str(tiny_dir), "--port", "0"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 90
        while not any(line.startswith("serving ") for line in lines):
            assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
            lines.append(process.stdout.readline())
        url = lines[-1].split(" at ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        body = httpx.post(f"{url}/completions", json={"prompt": [9, 10], "max_tokens": 3, "temperature": 0},
                          timeout=30).json()
        assert body["usage"]["completion_tokens"] == 3
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        rest = process.stdout.read()
        assert len(lines) + rest.count("\n") <= 4, "".join(lines) + rest  # quiet: a loading line and the URL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


@pytest.mark.slow
def test_the_default_smollm2_answers_a_chat_like_static_greedy_generate():
    model, tokenizer, name = load_trained_model()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=eos)
    want = tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)
    with running(create_app(model, tokenizer, name, batching_config(cache_tokens=2048))) as url:
        client = httpx.Client(base_url=url, timeout=120)
        body = client.post("/v1/chat/completions", json={"model": name, "messages": messages, "max_tokens": 24,
                                                         "temperature": 0}).json()
        events = [_event(line) for line in client.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": 24, "temperature": 0, "stream": True}).text.splitlines() if line]
    assert body["choices"][0]["message"]["content"] == want == streamed_text(events, chat=True)
    assert "Paris" in want


def test_dtype_auto_is_bfloat16_only_where_the_cpu_has_bf16_instructions():
    from engine.serving.model import resolve_dtype

    assert resolve_dtype("auto", "flags : fpu sse avx512f avx512_bf16 avx512_vnni")[0] == torch.bfloat16
    assert resolve_dtype("auto", "flags : fpu sse amx_bf16 amx_tile")[0] == torch.bfloat16
    dtype, why = resolve_dtype("auto", "flags : fpu sse avx2 avx512f")
    assert dtype == torch.float32 and "no bf16 instructions" in why
    assert resolve_dtype("bfloat16", "")[0] == torch.bfloat16 and resolve_dtype("float32", "")[0] == torch.float32
    with pytest.raises(ValueError, match="--dtype must be auto, float32, bfloat16; got 'fp16'"):
        resolve_dtype("fp16", "")


def test_a_bfloat16_model_serves_the_greedy_completion_of_its_static_generate(tiny_dir):
    # the weights and the KV cache in bf16 through the engine's continuous batching: the tokens of the same bf16
    # model's static greedy generate
    model, tokenizer, name = load_model(str(tiny_dir), dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    prompt = prompts(1, seed=3)[0]
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=EOS, pad_token_id=0)
    with torch.inference_mode():
        want = model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()
    app = create_app(model, tokenizer, name, batching_config(cache_tokens=4096, max_batch_tokens=128, page_size=16))
    with running(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        body = client.post("/v1/completions", json=dict(model=name, prompt=prompt, max_tokens=12,
                                                        temperature=0)).json()
    assert body["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True)
