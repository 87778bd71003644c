"""The steady-state arithmetic of benchmarks/bench_e2e.py on synthetic step records (no servers): warm-up steps
left out, phases per step, the generation/scoring split, the overlap limit and the printed efficiency."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_e2e.py"
spec = importlib.util.spec_from_file_location("bench_e2e", SCRIPT)
bench_e2e = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_e2e)


def step(wait, fwd_bwd, rest, tokens, duration=1.0, score=0.25):
    return {"perf/step_s": wait + fwd_bwd + 0.1 + 0.05 + rest, "perf/rollout_wait_s": wait, "perf/fwd_bwd_s": fwd_bwd,
            "perf/optimizer_s": 0.1, "perf/weight_sync_s": 0.05, "batch/trained_tokens_per_step": tokens,
            "rollout/duration_s": duration, "rollout/score_s": score, "rollout/inflight": 4.0,
            "batch/samples_per_step": 8.0}


def test_steady_state_leaves_out_the_warm_up_and_splits_the_wait():
    steps = [step(9.0, 9.0, 9.0, 1)] * 2 + [step(2.0, 1.0, 0.35, 100)] * 4
    time_s = {"startup": 3.0, "shutdown": 1.0, "total": 40.0}
    steady = bench_e2e.steady_state(steps, time_s, warmup_steps=2)
    assert steady["steps"] == 4
    assert steady["step_s"] == pytest.approx(3.5)
    assert steady["trained_tokens_per_s"] == pytest.approx(400 / 14.0)
    assert steady["phases_s"] == pytest.approx({"rollout_wait": 2.0, "fwd_bwd": 1.0, "optimizer": 0.1,
                                                "weight_sync": 0.05, "rest": 0.35})
    assert (steady["generation_s"], steady["scoring_s"]) == pytest.approx((1.5, 0.5))
    assert steady["startup_shutdown_share"] == pytest.approx(0.1)
    assert steady["rollout_capacity_s"] == pytest.approx(8 * 1.0 / 4.0)  # 4 in flight of 1 s each: 4 samples/s
    generation, training, limit = bench_e2e.overlap_limit(steady)
    assert (generation, training, limit) == pytest.approx((2.0, 1.5, 3.5 / 2.0))
    with pytest.raises(ValueError, match="leave none"):
        bench_e2e.steady_state(steps, time_s, warmup_steps=6)


def test_the_report_compares_async_over_sync_with_the_limit(capsys):
    time_s = {"startup": 1.0, "shutdown": 1.0, "total": 100.0}
    sync = bench_e2e.steady_state([step(2.0, 1.0, 0.85, 100)] * 3, time_s, 0)  # 4 s per step, G=2, T=2: limit 2
    fast = bench_e2e.steady_state([step(0.0, 1.0, 1.6, 100)] * 3, time_s, 0)  # 2.75 s per step: 4/2.75 = 1.45x
    report = bench_e2e.steady_report({"sync": [{"steady": sync}], "async": [{"steady": fast}]})
    assert report["overlap_limit"] == pytest.approx(2.0)
    assert report["steady_async_over_sync"] == pytest.approx(4.0 / 2.75)
    assert report["overlap_efficiency"] == pytest.approx(4.0 / 2.75 / 2.0)
    out = capsys.readouterr().out
    assert "(G + T) / max(G, T) = 2.00x" in out and "efficiency 73% of the limit" in out
    # async: capacity 8 x 1 s / 4 in flight = 2 s, training 2.75 s: bound 2.75 s per step, met at 100 %
    assert report["async_bound_step_s"] == pytest.approx(2.75)
    assert report["async_efficiency_own_bound"] == pytest.approx(1.0)
