"""The ways ``run.py bench serving`` serves a request set, each measured the same way (lab.bench.serving):
transformers' continuous batching (on the engine or on its own attention) and static ``generate`` batches; per
request its tokens and the times of its first and last token, per run its wall time and resident-memory peak."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

STALL_S = 300  # seconds without any output before a continuous-batching run is abandoned

__all__ = ["Request", "Served", "ResidentPeak", "batching_config", "greedy", "serve_continuous", "serve_static"]


class Request(NamedTuple):
    prompt: list[int]
    new_tokens: int


class Served(NamedTuple):
    """One way's run: per request (in submission order) its tokens and the times, in seconds after t = 0, of its first
    and last token; the run's wall time and its resident-memory peak above the start (None where unmeasurable)."""
    tokens: list[list[int]]
    first_token_s: list[float]
    finish_s: list[float]
    wall_s: float
    peak_bytes: int | None


def _proc_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))
    except (OSError, AttributeError):
        return None


class ResidentPeak:
    """Context manager: the process's resident high-water mark above its resident size at entry (``extra_bytes``,
    None where the mark cannot be reset). Freed heap memory is handed back first (``malloc_trim``), so what a way
    before left cached is not counted."""

    def __enter__(self) -> ResidentPeak:
        gc.collect()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)
        self.baseline, self.extra_bytes = _proc_kib("VmRSS"), None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident size
            self.reset = self.baseline is not None
        except OSError:
            self.reset = False
        return self

    def __exit__(self, *exc: object) -> None:
        peak = _proc_kib("VmHWM")
        if self.reset and peak is not None:
            self.extra_bytes = max(0, peak - self.baseline) * 1024


def batching_config(requests: Sequence[Request], page_size: int, batch_tokens: int, **options):
    """The continuous ways' config: blocks for every request at once, ``batch_tokens`` tokens per step; ``options``
    (e.g. ``allow_block_sharing``) passed on."""
    from transformers import ContinuousBatchingConfig

    blocks = sum(-(-(len(r.prompt) + r.new_tokens) // page_size) + 1 for r in requests)
    return ContinuousBatchingConfig(page_size=page_size, num_blocks=blocks, max_batch_tokens=batch_tokens,
                                    auto_switch_to_flash=False, **options)


def greedy(requests: Sequence[Request]):
    """Greedy decoding with eos disabled, so request r produces exactly ``r.new_tokens`` tokens."""
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                            max_new_tokens=max(r.new_tokens for r in requests))


def serve_continuous(model, requests: Sequence[Request], attn: str, config, on_engine: bool,
                     ticks: Callable[[], None] = lambda: None) -> Served:
    """Serve ``requests`` (all submitted at t = 0) with transformers' continuous batching under ``attn``, on the
    engine when ``on_engine`` (``attn`` "engine"); per-token times come from ``record_timestamps``."""
    from engine.integrations.transformers import continuous_batching

    generation = greedy(requests)
    model.set_attn_implementation(attn)
    with ResidentPeak() as peak, (continuous_batching(model) if on_engine else contextlib.nullcontext()), \
            torch.inference_mode():
        manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
        manager.start()
        try:
            start = time.perf_counter()
            ids = [manager.add_request(r.prompt, max_new_tokens=r.new_tokens, record_timestamps=True)
                   for r in requests]
            done: dict[str, Any] = {}
            progress = time.monotonic()  # when the last token or request arrived: a loop that stalls raises
            while len(done) < len(ids):
                result = manager.get_result(timeout=1.0)
                if result is None and not manager.is_running():
                    raise RuntimeError(f"the continuous-batching loop ({attn}) stopped with {len(done)} of "
                                       f"{len(ids)} requests done")
                if result is not None:
                    progress = time.monotonic()
                elif time.monotonic() - progress > STALL_S:
                    raise RuntimeError(f"the continuous-batching loop ({attn}) produced nothing for {STALL_S} s "
                                       f"with {len(done)} of {len(ids)} requests done")
                if result is not None and result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"request {result.request_id} ({attn}) failed: {result.error}")
                    done[result.request_id] = result
                    ticks()
        finally:
            manager.stop(block=True, timeout=60)
    tokens = [done[i].generated_tokens for i in ids]
    stamps = [done[i].timestamps[:len(t)] for i, t in zip(ids, tokens)]
    return Served(tokens, [s[0] - start for s in stamps], [s[-1] - start for s in stamps],
                  max(s[-1] for s in stamps) - start, peak.extra_bytes)


class TokenClock:
    """A ``generate`` streamer noting when each step's tokens arrive (``put`` gets the prompt first, then one call per
    step)."""

    def __init__(self) -> None:
        self.puts, self.times = 0, []

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts > 1:
            self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def serve_static(model, requests: Sequence[Request], batch: int, pad_id: int,
                 ticks: Callable[[], None] = lambda: None) -> Served:
    """Serve ``requests`` with ``model.generate`` (sdpa) on left-padded batches of ``batch``, in arrival order."""
    from transformers import GenerationConfig

    model.set_attn_implementation("sdpa")
    tokens, first, finish = [], [], []
    with ResidentPeak() as peak, torch.inference_mode():
        start = time.perf_counter()
        for at in range(0, len(requests), batch):
            group = requests[at:at + batch]
            longest, new = max(len(r.prompt) for r in group), max(r.new_tokens for r in group)
            ids = torch.tensor([[pad_id] * (longest - len(r.prompt)) + r.prompt for r in group])  # [b, longest]
            mask = torch.tensor([[0] * (longest - len(r.prompt)) + [1] * len(r.prompt) for r in group])
            clock = TokenClock()
            out = model.generate(ids, attention_mask=mask, streamer=clock, generation_config=GenerationConfig(
                do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=pad_id))  # [b, longest + new]
            if out.shape[1] != longest + new:
                raise RuntimeError(f"generate stopped after {out.shape[1] - longest} of {new} tokens")
            for row, r in zip(out[:, longest:].tolist(), group):
                tokens.append(row[:r.new_tokens])
                first.append(clock.times[0] - start)
                finish.append(clock.times[r.new_tokens - 1] - start)
                ticks()
    return Served(tokens, first, finish, max(finish), peak.extra_bytes)
