"""``run.py bench serving --peer`` (lab.bench.serving_peer, serving_http): rows and targets from replies of known
times; servers that never become ready, or exit, stopped with a clear error within their timeout; the load generator
against a stdlib OpenAI-compatible stub (a separate process: counted tokens, an error status, a stalled stream); and
the whole peer path end to end on loopback, ``run.py serve`` on a tiny model against the stub, through ``main`` into
a folder. Every process, request and wait has a timeout; every process is stopped after (asserted for the stub).

No speed is asserted (benchmarks are not tests): what is asserted is the tokens counted, the ratio columns and the
targets computed from the rows, the prompts each round sent, and the files.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")

from lab.bench import serving, serving_peer  # noqa: E402
from lab.bench.serving_http import Reply, ServerProcess, free_ports, run_load, stream_completion  # noqa: E402
from lab.bench.serving_peer import Round  # noqa: E402
from lab.bench.serving_ways import Request  # noqa: E402
from tests.test_serving import save_tiny_model  # noqa: E402

pytestmark = pytest.mark.timeout(240)  # every wait below has its own, shorter, timeout


def stub_server(port: int, token_delay: float, ready_after: float, status: int, stall: bool) -> None:
    """A stdlib OpenAI-compatible server (run as its own script: it imports only the standard library). ``/health``
    answers 503 for ``ready_after`` s, then 200; ``/v1/completions`` streams ``max_tokens`` chunks "x " each
    ``token_delay`` s apart and a usage chunk, or answers ``status`` (when not 200), or sends headers and then nothing
    (``stall``). Each request's prompt length, a digest of its ids and its fields go to stdout."""
    import hashlib
    import json
    import os
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    started = time.monotonic()
    print(f"pid {os.getpid()}", flush=True)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends when the connection closes

        def log_message(self, *args) -> None:
            pass

        def reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                ready = time.monotonic() - started >= ready_after
                self.reply(200 if ready else 503, {"status": "ok" if ready else "loading"})
            elif self.path == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": "stub", "object": "model"}]})
            else:
                self.reply(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body["prompt"]
            digest = hashlib.sha256(json.dumps(prompt).encode()).hexdigest()[:12]
            print(f"request {len(prompt)} {digest} {body['max_tokens']} {body.get('ignore_eos')} "
                  f"{body.get('temperature')} {body.get('stream')}", flush=True)
            if status != 200:
                return self.reply(status, {"error": {"message": f"the stub answers {status}"}})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            if stall:
                time.sleep(60)
                return
            for _ in range(body["max_tokens"]):
                time.sleep(token_delay)
                self.wfile.write(b'data: {"choices": [{"index": 0, "text": "x "}]}\n\n')
                self.wfile.flush()
            usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
                     "total_tokens": len(prompt) + body["max_tokens"]}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def stub_command(folder: Path, token_delay: float = 0.002, ready_after: float = 0.0, status: int = 200,
                 stall: bool = False) -> str:
    """A shell command that runs ``stub_server`` on ``{port}`` (the script written into ``folder``)."""
    script = folder / "stub_peer.py"
    script.write_text(inspect.getsource(stub_server) + "\n\nimport sys\n"
                      f"stub_server(int(sys.argv[1]), {token_delay}, {ready_after}, {status}, {stall})\n")
    return f"{sys.executable} {script} {{port}}"


def started_stub(folder: Path, **options) -> ServerProcess:
    port = free_ports(1)[0]
    words = stub_command(folder, **options).replace("{port}", str(port)).split()
    server = ServerProcess(words, f"http://127.0.0.1:{port}", folder / "stub.log", ready_timeout=30)
    server.start()
    return server


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    return parser.parse_args(list(flags))


def processes_naming(text: str) -> list[int]:
    """The pids of running processes whose command line holds ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ---- rows and targets from known times -------------------------------------------------------------------------


def replies(ttft: float, tpot: float, tokens: list[int]) -> list[Reply]:
    """Requests all sent at 0, each first chunk at ``ttft`` s, then one token each ``tpot`` s."""
    return [Reply(0.0, ttft, ttft + tpot * (n - 1), n, "x") for n in tokens]


def test_way_row_and_targets_from_replies_of_known_times():
    asked = [Request([5] * 10, 4), Request([5] * 20, 6)]
    ours = Round(replies(0.2, 0.05, [4, 6]), wall_s=1.0, others_cpu=3.0)    # 10 tokens / 1 s
    peer = Round(replies(0.1, 0.04, [4, 6]), wall_s=0.5, others_cpu=1.0)    # 10 tokens / 0.5 s
    slow = Round(replies(0.3, 0.05, [4, 5]), wall_s=2.0, others_cpu=40.0)   # a second round: one request short
    row = serving_peer.way_row("C=2", "engine", ours, peer, [ours, slow], [30.0, 4.0, 6.0], 2**30, 1, asked)
    assert row["tokens"] == 10 and row["asked"] == 10 and row["short"] == 0 and row["prompt tokens"] == 30
    assert row["tok/s"] == pytest.approx(10.0) and row["vs peer"] == pytest.approx(0.5)
    assert row["TTFT p50 ms"] == pytest.approx(200.0) and row["TPOT p50 ms"] == pytest.approx(50.0)
    assert row["first start s"] == 30.0 and row["start to ready s"] == 5.0  # the median of the later starts
    assert row["others CPU %"] == 3.0 and row["round others CPU %"] == [3.0, 40.0]  # the chosen round's, and all
    assert row["peak MiB"] == 1024.0 and row["round walls s"] == [1.0, 2.0]
    assert serving_peer.way_row("C=2", "engine", slow, peer, [slow], [], None, 0, asked)["short"] == 1
    peer_row = serving_peer.way_row("C=2", "peer", peer, peer, [peer], [1.0, 0.8], None, 1, asked)
    assert peer_row["vs peer"] == 1.0 and peer_row["start to ready s"] == 0.8
    checks = {c["target"].split(" ")[0] + c["target"].split(" ")[1]: c for c in serving_peer.targets([row, peer_row])}
    assert checks["outputtokens/s"]["value"] == pytest.approx(0.5) and checks["outputtokens/s"]["met"] == "no"
    assert checks["TTFTp50"]["value"] == pytest.approx(2.0) and checks["TTFTp50"]["met"] == "no"
    assert checks["TPOTp50"]["value"] == pytest.approx(1.25) and checks["TPOTp50"]["met"] == "yes"  # <= 1.5x
    assert checks["secondstart"]["value"] == 5.0 and checks["secondstart"]["met"] == "yes"
    assert checks["secondstart"]["peer"] == 0.8


def test_one_start_leaves_the_second_start_not_measured():
    asked = [Request([5] * 4, 3)]
    served = Round(replies(0.1, 0.01, [3]), 0.2, 0.0)
    rows = [serving_peer.way_row("C=1", way, served, served, [served], starts, None, 0, asked)
            for way, starts in (("engine", [12.0]), ("peer", []))]
    assert rows[0]["first start s"] == 12.0 and rows[0]["start to ready s"] is None
    assert rows[1]["first start s"] is None
    checks = serving_peer.targets(rows)
    assert checks[-1]["met"] == "not measured" and [c["met"] for c in checks[:3]] == ["yes", "yes", "yes"]


def test_every_round_sends_new_prompts_of_the_same_lengths():
    args = parse("--requests", "5", "--prompts", "4,30", "--new", "2,9")
    serving_peer.apply_defaults(args)
    assert args.concurrency == [4, 16] and args.starts == 3 and args.repeats == 2
    sets = [serving_peer.fresh_requests(serving.draw_requests, args, list(range(7, 128)), i) for i in range(-1, 4)]
    assert len({tuple(r.prompt) for s in sets for r in s}) == 5 * len(sets)
    assert all([(len(r.prompt), r.new_tokens) for r in s] == [(len(r.prompt), r.new_tokens) for r in sets[0]]
               for s in sets)
    assert all(7 <= t < 128 for s in sets for r in s for t in r.prompt)


def test_issue_28s_request_set_is_the_default_and_quick_is_small():
    args = parse("--peer", "http://127.0.0.1:1")
    serving_peer.apply_defaults(args)
    assert (args.requests, args.prompts, args.new) == (32, (16, 1024), (64, 128))
    quick = parse("--peer", "http://127.0.0.1:1", "--quick")
    serving_peer.apply_defaults(quick)
    assert (quick.requests, quick.prompts, quick.new, quick.concurrency) == (8, (16, 256), (16, 32), [4])


# ---- servers that never become ready ----------------------------------------------------------------------------


def test_a_server_that_never_becomes_ready_is_stopped_with_a_clear_error(tmp_path):
    port = free_ports(1)[0]
    server = ServerProcess([sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(120)"],
                           f"http://127.0.0.1:{port}", tmp_path / "never.log", ready_timeout=1.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"127.0.0.1:{port} was not ready within 2 s") as error:
        server.start()
    assert time.monotonic() - start < 30  # the timeout, then SIGINT ends it at once
    assert "loading" in str(error.value)  # the end of its log
    assert server.process is None


def test_a_server_started_with_sigint_ignored_is_stopped_at_once(tmp_path):
    # under nohup (or in a script's background) SIGINT is ignored, and a child inherits that: stop() sends SIGTERM
    port = free_ports(1)[0]
    server = ServerProcess([sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(120)"],
                           f"http://127.0.0.1:{port}", tmp_path / "ignored.log", ready_timeout=0.5)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="was not ready"):
            server.start()
        assert time.monotonic() - start < 10  # (SIGINT first: 20 s of grace)
    finally:
        signal.signal(signal.SIGINT, before)
        server.stop()
    assert server.process is None


def test_a_server_that_exits_before_ready_reports_its_log(tmp_path):
    server = ServerProcess([sys.executable, "-c", "print('no such model'); raise SystemExit(3)"],
                           f"http://127.0.0.1:{free_ports(1)[0]}", tmp_path / "exits.log", ready_timeout=60)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited before it was ready") as error:
        server.start()
    assert time.monotonic() - start < 30 and "no such model" in str(error.value)
    with pytest.raises(RuntimeError, match="could not start /no/such/server"):
        ServerProcess(["/no/such/server"], "http://127.0.0.1:1", tmp_path / "x.log", 5).start()


def test_a_peer_url_where_nothing_answers_fails_before_run_py_serve_starts(tmp_path):
    port = free_ports(1)[0]
    args = parse("--peer", f"http://127.0.0.1:{port}/v1", "--ready-timeout", "1", "--quiet", "--out", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"127.0.0.1:{port} was not ready within 1 s"):
        serving.main(args)
    assert time.monotonic() - start < 20 and not (tmp_path / "serve.log").exists()


# ---- the load generator against the stub ------------------------------------------------------------------------


def test_the_load_counts_each_streamed_token_and_keeps_request_order(tmp_path):
    server = started_stub(tmp_path, token_delay=0.001, ready_after=0.3)
    try:
        asked = [Request(list(range(7, 7 + n)), k) for n, k in ((3, 5), (8, 2), (5, 9), (2, 1))]
        got, wall = run_load(server.url, asked, concurrency=2, timeout=30)
        assert [r.tokens for r in got] == [5, 2, 9, 1] and [r.text for r in got] == ["x " * k for _, k in
                                                                                    ((3, 5), (8, 2), (5, 9), (2, 1))]
        assert all(0 <= r.sent_s <= r.first_s <= r.finish_s <= wall for r in got)
        log = (tmp_path / "stub.log").read_text()
        assert "request 8 " in log and " 2 True 0 True" in log  # ids, max_tokens, ignore_eos, greedy, streamed
    finally:
        server.stop()
    assert server.process is None


def test_an_error_status_and_a_stalled_stream_raise_within_the_timeout(tmp_path):
    failing = started_stub(tmp_path, status=500)
    try:
        with pytest.raises(RuntimeError, match="answered 500"):
            stream_completion(failing.url, [7, 8], 3, timeout=10, t0=time.perf_counter())
    finally:
        failing.stop()
    stalled = started_stub(tmp_path, stall=True)
    try:
        start = time.monotonic()
        with pytest.raises(OSError):  # the socket's timeout: a TimeoutError
            stream_completion(stalled.url, [7, 8], 3, timeout=1.0, t0=time.perf_counter())
        assert time.monotonic() - start < 10
    finally:
        stalled.stop()


# ---- the peer path end to end -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(folder)
    return folder


SMALL = ["--quiet", "--requests", "3", "--prompts", "4,12", "--new", "3,5", "--ready-timeout", "120",
         "--request-timeout", "60"]


@pytest.mark.slow
def test_bench_serving_peer_runs_serve_against_a_stub_peer_end_to_end(tiny_dir, tmp_path, capsys):
    out = tmp_path / "peer"
    command = stub_command(tmp_path, token_delay=0.002, ready_after=0.4)
    args = parse(*SMALL, "--model", str(tiny_dir), "--peer-command", command, "--concurrency", "1,2", "--starts",
                 "2", "--repeats", "2", "--out", str(out))
    assert serving.main(args) == 0
    for name in ("serving_peer.json", "serving_peer.csv", "serving_peer_targets.csv", "serving_peer.png"):
        assert (out / name).stat().st_size > 0, name
    saved = json.loads((out / "serving_peer.json").read_text())
    rows, asked = saved["rows"], serving.draw_requests(3, (4, 12), (3, 5), range(7, 128), args.seed)
    assert [(r["case"], r["way"]) for r in rows] == [(f"C={c}, 3 requests", w) for c in (1, 2)
                                                     for w in ("engine", "peer")]
    for row in rows:
        assert set(serving_peer.COLUMNS) <= set(row)
        assert row["tokens"] == row["asked"] == sum(r.new_tokens for r in asked) and row["short"] == 0  # ignore_eos
        assert row["prompt tokens"] == sum(len(r.prompt) for r in asked) and len(row["round walls s"]) == 2
        assert 0 < row["TTFT p50 ms"] <= row["TTFT p99 ms"] and 0 < row["TPOT p50 ms"] <= row["TPOT p99 ms"]
        assert row["tok/s"] == pytest.approx(row["tokens"] / row["wall s"])
        assert row["differing"] == 6  # the stub's texts are not the model's: 2 rounds of 3 requests
        assert row["first start s"] > 0 and row["start to ready s"] > 0 and row["peak MiB"] > 0
    for engine, peer in (rows[0:2], rows[2:4]):
        assert engine["vs peer"] == pytest.approx(engine["tok/s"] / peer["tok/s"]) and peer["vs peer"] == 1.0
    assert rows[1]["first start s"] >= 0.4  # the stub's /health says 503 for its first 0.4 s
    with (out / "serving_peer_targets.csv").open() as f:
        checks = list(csv.DictReader(f))
    assert len(checks) == 2 * 3 + 1 and checks[-1]["target"] == "second start to ready <= 10 s"
    expected = [engine[c] / peer[c] for engine, peer in (rows[0:2], rows[2:4])
                for c in ("tok/s", "TPOT p50 ms", "TTFT p50 ms")]
    assert [float(c["value"]) for c in checks[:-1]] == pytest.approx(expected)
    for check in checks[:-1]:
        sense, bound = check["target"].split()[-4], float(check["target"].split()[-3].rstrip("x"))
        value = float(check["value"])
        assert check["met"] == ("yes" if (value >= bound if sense == ">=" else value <= bound) else "no")
    assert float(checks[-1]["value"]) == rows[0]["start to ready s"]
    printed = capsys.readouterr().out
    assert "output tokens/s >= 1.0x the peer's" in printed and "wrote " in printed
    # the peer saw 2 warm-up requests per concurrency and 4 rounds of 3 new prompts, every prompt of a round new
    stub_log = (out / "peer.log").read_text()
    seen = re.findall(r"request (\d+) (\w+) (\d+) True 0 True", stub_log)
    measured = [s for s in seen if int(s[2]) != 2]
    assert len(seen) == 2 * 2 + 4 * 3 and len({s[1] for s in measured}) == 4 * 3
    pids = [int(p) for p in re.findall(r"pid (\d+)", stub_log)]
    assert len(pids) == 2 and all(gone(p) for p in pids)  # both starts stopped
    assert processes_naming(str(tiny_dir)) == []  # and every run.py serve


@pytest.mark.slow
def test_bench_serving_peer_against_a_running_peer_url(tiny_dir, tmp_path):
    stub = started_stub(tmp_path)
    try:
        out = tmp_path / "url"
        args = parse(*SMALL, "--model", str(tiny_dir), "--peer", stub.url + "/v1", "--concurrency", "2",
                     "--starts", "1", "--repeats", "1", "--out", str(out))
        assert serving.main(args) == 0
        assert stub.pid is not None  # a peer the bench did not start is left running
    finally:
        stub.stop()
    rows = json.loads((out / "serving_peer.json").read_text())["rows"]
    assert [r["way"] for r in rows] == ["engine", "peer"] and all(r["short"] == 0 for r in rows)
    assert rows[0]["start to ready s"] is None and rows[1]["first start s"] is None
    assert rows[1]["peak MiB"] is None  # not its process: not measured
    targets = (out / "serving_peer_targets.csv").read_text().splitlines()
    assert targets[-1].endswith("not measured")
