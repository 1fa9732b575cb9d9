"""What OpenAI's API asks of ``run.py serve``: the two requests (validated: a bad one is a 400, never a crash), the
sampling each asks of transformers' continuous-batching manager, and the bodies, stream chunks and errors it gets back.

Sampling, per request (the manager's per-request processors: temperature, then top-k, then top-p, then a draw)::

    request                         manager's per-request kwargs               tokens
    temperature 0 (or < 1e-5)       temperature 1.0, top_k 1, top_p 1.0        the argmax (one token is left to draw)
    temperature t >= 1e-5, top_p p  temperature t, top_k off, top_p p          a draw from the manager's generator
    + top_k k (not OpenAI's; vLLM)  ... top_k k                                ...

``seed`` is honoured only where it changes nothing (temperature 0): every request's draw comes from the manager's one
generator, in whatever order the batch holds them, so no per-request seed can make a sampled answer repeatable;
``seed`` with a sampled request is a 400 that says so. Fields that would change the tokens and have no per-request form
in the manager (``n``, penalties, ``logit_bias``, ``logprobs``, ``echo``, ``min_p``, ...) are accepted only at their
neutral value, and a 400 otherwise; other unknown fields (``user``, ``metadata``, ...) are ignored.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "GREEDY", "TextStream", "chunk_body",
           "completion_body", "error_body", "generation_config", "validation_message"]

GREEDY = {"temperature": 1.0, "top_k": 1, "top_p": 1.0}  # only the top token survives top-k: the draw is the argmax
GREEDY_BELOW = 1e-5  # the limit of sampling as the temperature falls (logits / 1e-38 would overflow float32)
TOP_K_OFF = 1 << 30  # larger than any vocabulary (the manager clamps it to the vocabulary size)

# Fields that change the tokens but have no per-request form in the manager: each one's neutral values.
NEUTRAL_ONLY: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "logit_bias": (None, {}), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "echo": (None, False), "suffix": (None, ""), "min_p": (None, 0), "min_tokens": (None, 0),
    "use_beam_search": (None, False), "length_penalty": (None, 1), "typical_p": (None, 1),
    "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "guided_json": (None,), "guided_regex": (None,),
}


def generation_config(eos_token_ids: list[int]):
    """The manager's one ``GenerationConfig``: sampling on, each default away from neutral so that transformers builds
    its per-request processor (none for temperature 1.0, top_k 0, top_p 1.0); every request overrides all three."""
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=True, temperature=0.5, top_k=1, top_p=0.5, max_new_tokens=16,
                            eos_token_id=eos_token_ids or -1)


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_message(error: ValidationError | Any) -> tuple[str, str | None]:
    """``(message, param)`` for a request that failed validation: each problem as ``field: what was wrong``."""
    problems, params = [], []
    for item in error.errors():
        loc = [str(part) for part in item.get("loc", ()) if part != "body"]
        if item.get("type") == "json_invalid":
            problems.append(f"the body is not valid JSON ({item.get('ctx', {}).get('error', 'decode error')})")
            continue
        field = ".".join(loc)
        params.append(field or None)
        problems.append(f"{field}: {item['msg']}" if field else item["msg"])
    return "; ".join(problems) or "invalid request", (params[0] if params else None)


class _Strict(BaseModel):
    # strict: "16" is not an int and 1 is not a bool; unknown fields are kept so that NEUTRAL_ONLY can read them
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingRequest(_Strict):
    """What both endpoints share: the model, how many tokens, how to sample, where to stop, whether to stream."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)  # NaN: "should be a finite number"
    top_p: float = Field(1.0, ge=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)  # not OpenAI's (vLLM's): None, -1 or 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # not OpenAI's (vLLM's, llama-server's): generate past EOS, up to max_tokens

    @model_validator(mode="after")
    def _only_what_the_manager_honours(self) -> SamplingRequest:
        for name, value in (self.model_extra or {}).items():
            if name in NEUTRAL_ONLY and value not in NEUTRAL_ONLY[name]:
                raise ValueError(f"{name}={value!r} is not supported: transformers' continuous batching has no "
                                 f"per-request {name} (accepted only as {NEUTRAL_ONLY[name][-1]!r})")
        if self.seed is not None and self.temperature >= GREEDY_BELOW:
            raise ValueError("seed is supported only with temperature 0: sampled requests draw from the manager's "
                             "one shared generator, in batch order, so a per-request seed cannot make them repeatable")
        if len(self.stops()) > 4 or any(not s for s in self.stops()):
            raise ValueError("stop takes up to 4 non-empty strings")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling(self) -> dict[str, float | int]:
        """The manager's per-request processor kwargs (module docstring's table)."""
        if self.temperature < GREEDY_BELOW:
            return dict(GREEDY)
        top_k = self.top_k if self.top_k and self.top_k > 0 else TOP_K_OFF
        return {"temperature": float(self.temperature), "top_k": top_k, "top_p": float(self.top_p)}

    def token_limit(self) -> int | None:
        """How many tokens to generate at most (None: the rest of the context window)."""
        return self.max_tokens

    def wants_usage_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt, as text or as token ids."""

    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions

    def prompt_ids(self, tokenizer, vocabulary: int) -> list[int]:
        if isinstance(self.prompt, str):
            return tokenizer(self.prompt).input_ids
        if any(not 0 <= i < vocabulary for i in self.prompt):
            raise APIError(400, f"prompt token ids must lie in [0, {vocabulary})", param="prompt")
        return list(self.prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: messages through the model's chat template (``max_completion_tokens`` is the
    newer name of ``max_tokens``; without either, the rest of the context window)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def prompt_ids(self, tokenizer, vocabulary: int) -> list[int]:
        """The messages through the tokenizer's chat template, ending with the assistant's turn opened."""
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in self.messages]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as error:  # a template may refuse a conversation (roles out of order, ...)
            raise APIError(400, f"the chat template refused these messages: {error}", param="messages") from error
        return tokenizer(text, add_special_tokens=False).input_ids


class TextStream:
    """A request's generated token ids in, the text that may be sent out: OpenAI's stop strings end the text just
    before the first one, and a tail that could still grow into one (or an incomplete character) is held back::

        stop ["\\n\\n"]   tokens  "Hi" "\\n"    -> sends "Hi" (holds "\\n": it may begin "\\n\\n")
                        + "\\nBye"            -> text "Hi\\n\\nBye" holds the stop at 2: sends "", stopped, text "Hi"
    """

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer, self.stops, self.sent, self.stopped = tokenizer, stops, "", False

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """The new text to send after ``token_ids`` (all the tokens so far); ``final``: nothing held back."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, ready = True, min(hits)
        elif final:
            ready = len(text)
        else:
            ready = len(text.rstrip("\ufffd"))  # U+FFFD: the bytes of a character still arriving
            ready -= self._held_back(text[:ready])
        delta = text[len(self.sent):ready]
        self.sent = text[:max(ready, len(self.sent))]
        return delta

    def _held_back(self, text: str) -> int:
        """The length of the longest tail of ``text`` that begins a stop string (0: none)."""
        longest = max((len(s) for s in self.stops), default=1)
        return max((k for k in range(1, min(len(text), longest - 1) + 1)
                    if any(s.startswith(text[-k:]) for s in self.stops)), default=0)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(chat: bool, request_id: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
                    completion_tokens: int) -> dict:
    """A whole (non-streamed) response: ``text_completion`` or ``chat.completion``."""
    choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def chunk_body(chat: bool, request_id: str, model: str, text: str | None, finish_reason: str | None = None,
               usage_counts: tuple[int, int] | None = None) -> dict:
    """One server-sent event's data. Chat: ``text=None`` is the opening delta (the role); a chunk with
    ``usage_counts`` has no choices (``stream_options.include_usage``)."""
    if usage_counts is not None:
        choices = []
    elif chat:
        delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}]
    body = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices}
    if usage_counts is not None:
        body["usage"] = usage(*usage_counts)
    return body
