"""``run.py bench serving``'s machinery on tiny random-weight models (the 17 s GGUF load is left to the bench): the
three ways of the smollm2 group on a small Llama, and the softcap-sinks group through ``main`` into a folder.

No timing is asserted (benchmarks are not tests): what is asserted is the rows, that every way produced exactly the
requested tokens and the same greedy tokens, that the metrics are positive and ordered, and the files.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
pytest.importorskip("engine.integrations.transformers")

from lab.bench import serving  # noqa: E402
from tests.test_hf_models import VOCAB, build  # noqa: E402

# 3 requests, prompts 5..40 tokens (longer than a step's 32 tokens: chunked prefill), 4..7 new tokens, pages of 16
SMALL = ["--quiet", "--threads", "1", "--requests", "3", "--prompts", "5,40", "--new", "4,7", "--batch", "2",
         "--page-size", "16", "--batch-tokens", "32"]

pytestmark = pytest.mark.timeout(300)  # a continuous-batching loop that stalls fails the test, never hangs it


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    return parser.parse_args(list(flags))


def assert_metrics(row: dict) -> None:
    assert row["tokens"] > 0 and row["wall s"] > 0 and row["tok/s"] > 0 and row["vs peer"] > 0
    assert 0 < row["TTFT p50 ms"] <= row["TTFT p99 ms"] <= 1e3 * row["wall s"]
    assert 0 < row["TPOT p50 ms"] <= row["TPOT p99 ms"]
    assert row["peak MiB"] is None or row["peak MiB"] >= 0


def test_draw_requests_gives_every_vocabulary_the_same_lengths():
    small = serving.draw_requests(5, (16, 64), (3, 9), range(3, 100), seed=7)
    large = serving.draw_requests(5, (16, 64), (3, 9), range(1000, 40000), seed=7)
    assert [(len(r.prompt), r.new_tokens) for r in small] == [(len(r.prompt), r.new_tokens) for r in large]
    assert all(16 <= len(r.prompt) <= 64 and 3 <= r.new_tokens <= 9 for r in small)
    assert all(3 <= t < 100 for r in small for t in r.prompt)
    assert small == serving.draw_requests(5, (16, 64), (3, 9), range(3, 100), seed=7)  # a fixed seed


def test_three_ways_serve_a_tiny_llama_with_the_same_greedy_tokens():
    args = parse(*SMALL)
    model = build("llama-gqa", "engine")
    rows = serving.smollm2_rows(model, "tiny llama", range(3, VOCAB), 0, args)
    assert [r["way"] for r in rows] == ["engine", "sdpa CB", "static generate"]
    requests = serving.draw_requests(3, (5, 40), (4, 7), range(3, VOCAB), args.seed)
    for row in rows:
        assert set(serving.COLUMNS) <= set(row)
        assert row["requests"] == 3 and row["tokens"] == sum(r.new_tokens for r in requests)  # eos disabled
        assert row["differing"] == 0, row["way"]  # greedy tokens equal the peer's on this model
        assert row["peer"] == "sdpa CB" and len(row["round walls s"]) == 1
        assert_metrics(row)
    engine, peer, static = rows
    assert peer["vs peer"] == 1.0
    assert engine["target"] == f">= {serving.TARGET}x" and engine["met"] == ("yes" if engine["vs peer"] >= 1.2
                                                                            else "no")
    assert peer["target"] is None and static["target"] is None
    assert model.config._attn_implementation == "sdpa"  # the last way (static generate) set it; nothing else stuck


def test_main_runs_the_softcap_sinks_group_and_writes_its_files(tmp_path, capsys):
    out = tmp_path / "serving"
    assert serving.main(parse(*SMALL, "--requests", "2", "--prompts", "5,20", "--new", "3,4", "--groups",
                              "softcap-sinks", "--out", str(out))) == 0
    for name in ("serving.json", "serving.csv", "serving.png"):
        assert (out / name).stat().st_size > 0, name
    saved = json.loads((out / "serving.json").read_text())
    rows = saved["rows"]
    assert saved["meta"]["arrivals"] == "all at t = 0" and saved["meta"]["threads"] == 1
    assert [(r["case"], r["way"]) for r in rows] == [("gemma2 softcap", "engine"), ("gemma2 softcap", "eager CB"),
                                                     ("gpt-oss sinks", "engine"), ("gpt-oss sinks", "eager CB")]
    for row in rows:
        assert row["peer"] == "eager CB" and row["target"] is None
        assert_metrics(row)
    # gpt-oss: the same greedy tokens; Gemma 2: eager CB drops the softcap (a note says so), tokens may differ
    assert [r["differing"] for r in rows if r["case"] == "gpt-oss sinks"] == [0, 0]
    assert set(saved["meta"]["notes"]) == {"gemma2 softcap"}
    assert "TTFT p50 ms" in (out / "serving.csv").read_text().splitlines()[0]
    printed = capsys.readouterr().out
    assert "vs eager CB" in printed and "differ from eager CB" in printed and "note (gemma2 softcap)" in printed


def test_main_rejects_unknown_groups(tmp_path, capsys):
    assert serving.main(parse("--groups", "smollm2,nope", "--out", str(tmp_path))) == 2
    assert "--groups takes a comma-separated list of smollm2, softcap-sinks" in capsys.readouterr().out


def test_the_prefix_group_shares_pages_and_keeps_the_greedy_tokens(tmp_path, monkeypatch):
    # requests with a common 40-token prefix (two full pages of 16), one after another: with block sharing the later
    # ones prefill only their own tokens (counted at the engine's planning), and every request's tokens are the
    # same either way
    import engine.integrations.transformers.continuous as continuous
    from lab.bench import serving_prefix

    planned, plan_batch = [], continuous.plan_batch
    monkeypatch.setattr(continuous, "plan_batch", lambda q, k, v, cu_q, *rest: (
        planned.append(int(cu_q[-1])), plan_batch(q, k, v, cu_q, *rest))[1])
    args = parse(*SMALL, "--prefix", "40")
    model = build("llama-gqa", "engine")
    requests = serving_prefix.prefix_requests(3, 40, 4, range(3, VOCAB), args.seed)
    assert all(r.prompt[:40] == requests[0].prompt[:40] and 56 <= len(r.prompt) <= 104 for r in requests)
    queried = {}
    for share in (False, True):
        planned.clear()
        served = serving_prefix.serve_in_turn(model, requests, share, 16, 32)
        queried[share] = sum(planned)
        assert [len(t) for t in served["tokens"]] == [4, 4, 4] and all(t > 0 for t in served["ttft"])
    assert queried[True] <= queried[False] - 2 * 32  # the two later requests skipped their two shared pages
    args.requests, args.new = 3, (4, 4)
    rows, chosen = serving_prefix.prefix_rows(model, "tiny llama", range(3, VOCAB), args)
    assert [r["way"] for r in rows] == list(serving_prefix.WAYS)
    assert all(r["differing"] == 0 and set(serving_prefix.COLUMNS) <= set(r) for r in rows)
    assert rows[1]["speed-up"] == 1.0 and all(0 < r["later TTFT p50 ms"] <= r["later TTFT p99 ms"] for r in rows)
    serving_prefix.plot(rows, chosen, tmp_path / "prefix.png")
    assert (tmp_path / "prefix.png").stat().st_size > 0
