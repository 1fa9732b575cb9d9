"""Context parallelism over real processes (gloo, loopback): every rank's output, lse and gradients equal one
process's ``causal_attention`` on the whole sequence, for 1 to 4 ranks, both methods; bad calls and dead
ranks fail on every rank with a clear error, never a hang."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_cases import (
    CASES,
    auto_method_choice,
    compare_with_single_process,
    in_turn,
    mismatched_heads,
    one_rank_dies,
    run_ranks,
    tiny_training,
)

pytestmark = pytest.mark.multiprocess

# float64 cases must agree to rounding; bf16 to its precision (the merge of P parts rounds each part's output)
TOLERANCE = {"torch.float64": 1e-12, "torch.bfloat16": 5e-2}

# What the ranks of each world run for the tests below, in order, in one spawn of that world's processes (a rank's
# start-up, ~1.3 s of imports per process on two cores, was most of each test's time); each test asserts on its own
# call's results, as when it spawned its ranks alone. The ranks that die (one_rank_dies) keep their own spawns.
CALLS = {
    1: [(compare_with_single_process, ("ring",))],
    2: [(compare_with_single_process, (method,)) for method in ("ring", "allgather", "direct")]
       + [(tiny_training, ())],
    3: [(compare_with_single_process, (method,)) for method in ("ring", "allgather", "direct", "auto")]
       + [(tiny_training, ()), (mismatched_heads, ())],  # (every rank raises: last)
    4: [(compare_with_single_process, (method,)) for method in ("ring", "direct")]
       + [(auto_method_choice, ())],  # (it wraps the methods' apply in the ranks' processes: last)
}


@pytest.fixture(scope="module")
def ranks():
    """``ranks(fn, world, *args)``: each rank's result of ``fn(rank, world, *args)``, run in that world's shared
    spawn (CALLS); a rank whose whole run failed (or died) gives its error for every call."""
    spawned = {}

    def results(fn, world, *args):
        if world not in spawned:
            try:
                spawned[world] = run_ranks(in_turn, world, CALLS[world], deadline_s=60.0 * len(CALLS[world]))
            except TimeoutError as error:  # every test of this world fails with it (and none spawns it again)
                spawned[world] = error
        if isinstance(spawned[world], TimeoutError):
            raise spawned[world]
        index = CALLS[world].index((fn, args))
        return [done[index] if isinstance(done, list) else done for done in spawned[world]]

    return results


@pytest.mark.parametrize("world, method", [(1, "ring"), (2, "ring"), (3, "ring"), (4, "ring"), (2, "allgather"),
                                           (3, "allgather"), (2, "direct"), (3, "direct"), (4, "direct"),
                                           (3, "auto")])
def test_every_rank_equals_one_process(world, method, ranks):
    results = ranks(compare_with_single_process, world, method)
    for rank, errors in enumerate(results):
        assert "error" not in errors, errors.get("traceback", errors)
        assert set(errors) == set(CASES)
        for case, e in errors.items():
            tol = TOLERANCE[e["dtype"]]
            assert e["lse_inf_pattern"], (rank, case)
            for what in ("out", "lse", "dq", "dk", "dv", "dbias"):
                if what in e:
                    assert e[what] <= tol, (rank, case, what, e[what])
    # sinks' and a bias table's gradient: each rank's share covers its rows; summed over the ranks (DDP's
    # all-reduce), one process's
    for case in ("sinks", "relative_bias"):
        total = sum(errors[case]["dshared_share"] for errors in results)
        torch.testing.assert_close(total, results[0][case]["dshared_full"], rtol=1e-12, atol=1e-12)


def test_a_rank_with_other_shapes_is_named_on_every_rank(ranks):
    results = ranks(mismatched_heads, 3)
    for result in results:
        assert result["error"] is not None
        assert "ValueError: context_parallel_attention: rank 1 has Hkv=4 but rank 0 has Hkv=2" in result["error"]


@pytest.mark.parametrize("method", ["auto", "direct"])
@pytest.mark.parametrize("mid_ring", [False, True], ids=["between_calls", "mid_ring"])
def test_a_dead_rank_makes_the_others_fail_within_the_timeout(mid_ring, method):
    results = run_ranks(one_rank_dies, 3, mid_ring, method, deadline_s=90)
    assert results[1] == {"error": "no result (died)"}
    for rank in (0, 2):
        assert results[rank]["seconds"] < 30, results[rank]  # the group's timeout is 20 s: never a hang
        if method == "direct" and mid_ring and results[rank]["raised"] is None:
            continue  # direct: rank 1 had posted every transfer before it died, so its peers' call completed
        assert results[rank]["raised"] == "RuntimeError", results[rank]
        assert "context_parallel_attention: rank" in results[rank]["message"], results[rank]


@pytest.mark.parametrize("world", [2, 3])
def test_training_over_ranks_follows_the_loss_curve_of_one_process(world, ranks):
    results = ranks(tiny_training, world)
    for curves in results:
        assert "error" not in curves, curves.get("traceback", curves)
        one, parallel = curves["one process"], curves["context parallel"]
        assert one[-1] < one[0]  # it trains
        assert all(abs(a - b) <= 1e-10 * max(1.0, abs(a)) for a, b in zip(one, parallel)), (one, parallel)


def test_auto_sends_a_window_to_neighbours_and_a_causal_zigzag_round_the_ring(ranks):
    results = ranks(auto_method_choice, 4)
    for rank, result in enumerate(results):
        assert "error" not in result, result.get("traceback", result)
        assert result == {"window": "direct", "causal": "ring"}, (rank, result)
