"""What ``run.py bench serving --peer`` (lab.bench.serving_peer) does over HTTP: start a server and time it to ready,
stop it, and send it a request set.

Both servers are separate processes. ``run.py serve`` is started by the bench ``--starts`` times: the first with an
empty weights cache (a first start: the GGUF converted), the others with that cache (second starts); the peer is
started ``--starts`` times by ``--peer-command`` (``{port}`` in it: a free port, and ``--peer`` defaults to
``http://127.0.0.1:{port}``), or only waited for at ``--peer``. Start to ready: from the process's start until
``GET /health`` answers 200 (or, where a server has no /health, ``GET /v1/models``). The last start of each stays up
for the load and is stopped after (its whole process group: SIGINT, then SIGTERM, then SIGKILL).

The load (stdlib ``http.client``, one thread per request in flight): a request set is sent with at most C requests
in flight, each ``POST /v1/completions`` streamed, greedy, ``ignore_eos`` so that
request r makes exactly ``new[r]`` tokens. Per request: TTFT from its send to its first text chunk, TPOT = (last
text chunk - first) / (tokens - 1), tokens from the final usage chunk. Every request has a timeout and every wait a
deadline: nothing here can hang. Per round: the CPU others used (machine busy time less both servers' and the bench's,
from /proc), in % of one core.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[2]
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

__all__ = ["Reply", "ServerProcess", "base_url", "cpu_sample", "free_ports", "run_load", "stream_completion"]


class Reply(NamedTuple):
    """One streamed completion: seconds after the round's start when it was sent, when its first and last text
    chunks arrived; its token count (the usage chunk's, else the text chunks') and its text."""
    sent_s: float
    first_s: float
    finish_s: float
    tokens: int
    text: str


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (all bound at once, so the system cannot hand out one twice)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def base_url(url: str) -> str:
    """``http://host:port`` of a server URL given with or without ``/v1`` or a trailing slash."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or not parts.port:
        raise ValueError(f"expected a server URL like http://127.0.0.1:8080 (http, a host and a port), got {url!r}")
    return f"http://{parts.hostname}:{parts.port}"


def _connection(url: str, timeout: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)


def _status(url: str, path: str, timeout: float = 2.0) -> int | None:
    """The status of ``GET path``, None where nothing answers."""
    connection = _connection(url, timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()


def is_ready(url: str) -> bool:
    health = _status(url, "/health")
    return health == 200 or (health == 404 and _status(url, "/v1/models") == 200)


def wait_ready(url: str, timeout: float, alive: Callable[[], bool] = lambda: True) -> float:
    """Seconds until ``url`` is ready; RuntimeError after ``timeout`` or once ``alive()`` is False."""
    start = time.monotonic()
    while not is_ready(url):
        if not alive():
            raise RuntimeError(f"the server for {url} exited before it was ready")
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"{url} was not ready within {timeout:.0f} s")
        time.sleep(0.05)
    return time.monotonic() - start


class ServerProcess:
    """A server started from ``command`` in its own process group (its output to ``log``), ready at ``url``."""

    def __init__(self, command: Sequence[str], url: str, log: Path, ready_timeout: float) -> None:
        self.command, self.url, self.log, self.ready_timeout = list(command), url, Path(log), ready_timeout
        self.process: subprocess.Popen | None = None

    def start(self) -> float:
        """Start it; seconds from the start until it is ready (it is stopped if it never is)."""
        if is_ready(self.url):
            raise RuntimeError(f"something already answers at {self.url}: stop it, or pick another port")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            start = time.monotonic()
            try:
                self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as error:
                raise RuntimeError(f"could not start {shlex.join(self.command)}: {error}") from None
        try:
            wait_ready(self.url, self.ready_timeout, lambda: self.process.poll() is None)
        except RuntimeError as error:
            self.stop()
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{error}: {shlex.join(self.command)}\n--- the end of {self.log} ---\n{tail}") from None
        return time.monotonic() - start

    @property
    def pid(self) -> int | None:
        return None if self.process is None or self.process.poll() is not None else self.process.pid

    def stop(self) -> None:
        """Its process group: SIGINT, then SIGTERM, then SIGKILL, each given time to end it. Where this process ignores
        SIGINT (started by nohup, or in the background of a shell script), the server inherited that and would sit out
        SIGINT's grace: SIGTERM comes first."""
        if self.process is None:
            return
        steps = [(signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 10)]
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            steps = steps[1:]
        for sent, grace in steps:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sent)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace)
                break
        self.process = None

    def peak_bytes(self) -> int | None:
        """Its resident high-water mark since it started (VmHWM), None when not running."""
        try:
            with open(f"/proc/{self.pid}/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        except (OSError, StopIteration, TypeError):
            return None


def _cpu_seconds(pid: int | str | None) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
    except (OSError, IndexError, ValueError):
        return 0.0


def cpu_sample(pids: Sequence[int | None]) -> tuple[float, float]:
    """``(machine busy s, busy s of pids and of this process)`` now, from /proc ((0, 0) where it is missing)."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        busy = (sum(values[:8]) - values[3] - values[4]) / TICK  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    return busy, sum(_cpu_seconds(p) for p in pids if p) + _cpu_seconds("self")


def stream_completion(url: str, prompt: list[int], new_tokens: int, timeout: float, t0: float) -> Reply:
    """One greedy streamed ``/v1/completions`` of exactly ``new_tokens`` (``ignore_eos``), timed from ``t0``."""
    body = json.dumps({"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}})
    deadline = time.monotonic() + timeout
    connection = _connection(url, timeout)
    sent = time.perf_counter() - t0
    first = last = None
    chunks, usage, text = 0, None, []
    try:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{url}/v1/completions answered {response.status}: {response.read()[:500]!r}")
        for raw in response:
            if time.monotonic() > deadline:
                raise TimeoutError(f"a completion from {url} took more than {timeout:.0f} s")
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"{url} streamed an error: {event['error']}")
            usage = event.get("usage") or usage
            piece = "".join(c.get("text") or "" for c in event.get("choices") or [])
            if piece:
                last = time.perf_counter() - t0
                first = last if first is None else first
                chunks += 1
                text.append(piece)
    finally:
        connection.close()
    if first is None:
        raise RuntimeError(f"{url} streamed no text for a prompt of {len(prompt)} tokens")
    tokens = int(usage["completion_tokens"]) if usage and usage.get("completion_tokens") else chunks
    return Reply(sent, first, last, tokens, "".join(text))


def run_load(url: str, requests: Sequence[Any], concurrency: int, timeout: float,
             ticks: Callable[[], None] = lambda: None) -> tuple[list[Reply], float]:
    """``(replies in request order, wall s)``: the requests sent with at most ``concurrency`` in flight."""
    t0 = time.perf_counter()

    def one(request) -> Reply:
        reply = stream_completion(url, request.prompt, request.new_tokens, timeout, t0)
        ticks()
        return reply

    pool = ThreadPoolExecutor(concurrency)
    try:
        futures = [pool.submit(one, r) for r in requests]
        replies = [f.result(timeout=timeout * len(requests)) for f in futures]
    finally:  # on a failure the requests not sent yet are dropped; those in flight end by their own timeouts
        pool.shutdown(wait=True, cancel_futures=True)
    return replies, max(r.finish_s for r in replies)


def serve_command(model: str | None, port: int, dtype: str, weights_cache: Path) -> list[str]:
    """``run.py serve`` on ``port`` (this interpreter, this checkout)."""
    return [sys.executable, str(ROOT / "run.py"), "serve", *([model] if model else []), "--port", str(port),
            "--dtype", dtype, "--weights-cache", str(weights_cache)]


def peer_command(command: str, port: int) -> list[str]:
    """``--peer-command``'s words, ``{port}`` replaced."""
    words = shlex.split(command.replace("{port}", str(port)))
    if not words:
        raise ValueError("--peer-command is empty")
    return words
