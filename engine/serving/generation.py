"""One request's life in the continuous-batching manager: ``Generation`` adds it, turns its token snapshots into text
deltas (stop strings cut them), and ``close`` cancels it unless it finished there, however it ends; ``Served`` is
what every request reads (engine.serving.server builds it when the manager starts)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.serving import manager_internals as internals
from engine.serving import openai_api as api

__all__ = ["Served", "Generation"]


@dataclass
class Served:
    """What every request reads: the model's tokenizer and limits, the running manager, the open requests."""

    model: object
    tokenizer: object
    name: str
    manager: object
    eos_token_ids: list[int]
    context_length: int
    open: set[str] = field(default_factory=set)


class Generation:
    """One request in the manager: snapshots in, text deltas out (``deltas``), then ``finish_reason``, ``tokens``."""

    def __init__(self, served: Served, prompt_ids: list[int], max_tokens: int, sampling: dict,
                 stops: list[str], chat: bool, ignore_eos: bool = False) -> None:
        self.served, self.prompt_ids, self.chat = served, prompt_ids, chat
        self.eos_token_ids = [] if ignore_eos else served.eos_token_ids  # ignore_eos: only max_tokens ends it
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.text = api.TextStream(served.tokenizer, stops)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.done_in_manager = False
        self._outputs: asyncio.Queue = asyncio.Queue()
        manager = served.manager
        manager.register_result_handler(self.id, self._outputs.put_nowait)  # before the request: none is missed
        served.open.add(self.id)
        accepted = None
        try:
            accepted = manager.add_request(prompt_ids, request_id=self.id, max_new_tokens=max_tokens,
                                           streaming=True, eos_token_id=self.eos_token_ids or -1, **sampling)
        finally:
            if accepted is None:  # refused or raised: leave nothing behind
                self.close()
        if accepted is None:
            raise api.APIError(503, "the generation loop is not accepting requests", kind="server_error")

    async def deltas(self) -> AsyncIterator[str]:
        while self.finish_reason is None:
            output = await self._outputs.get()
            if output.error is not None:
                self.done_in_manager = True
                raise api.APIError(500, f"generation failed: {output.error}", kind="server_error")
            self.done_in_manager = output.is_finished()
            self.tokens = list(output.generated_tokens)
            delta = self.text.update(self.tokens, final=self.done_in_manager)
            if self.text.stopped:
                self.finish_reason = "stop"
            elif self.done_in_manager:
                ended_on_eos = bool(self.tokens) and self.tokens[-1] in self.eos_token_ids
                self.finish_reason = "stop" if ended_on_eos else "length"
            if delta:
                yield delta

    def close(self) -> None:
        """Idempotent: cancel the request unless it finished in the manager. A cancelled request never delivers a
        last output, so its result handler is dropped here; a token of the step it was in when cancelled then lands
        in the manager's shared queue, which nothing else here reads: drained (of every such orphan) here too."""
        manager = self.served.manager
        if not self.done_in_manager:
            manager.cancel_request(self.id)
            self.done_in_manager = True
        internals.drop_result_handler(manager, self.id)
        internals.drain_unread_results(manager)
        self.served.open.discard(self.id)
