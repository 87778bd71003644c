"""The clock and steady-state arithmetic of benchmarks/bench_e2e.py (in benchmarks/e2e_clock.py) on synthetic records
(no servers): one clock for fastdistill and TRL (whole run, steady state after the same k steps, start-up, fill and
shut-down), the paired ratios on both clocks, warm-up steps left out of the phases, the generation/scoring split,
the overlap limit and the printed efficiency; bench_e2e's variant option."""

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


e2e_clock = load("e2e_clock")
bench_e2e = load("bench_e2e")


def step(wait, fwd_bwd, rest, tokens, duration=1.0, score=0.25):
    return {"perf/step_s": wait + fwd_bwd + 0.1 + 0.05 + rest, "perf/rollout_wait_s": wait, "perf/fwd_bwd_s": fwd_bwd,
            "perf/optimizer_s": 0.1, "perf/weight_sync_s": 0.05, "batch/trained_tokens_per_step": tokens,
            "rollout/duration_s": duration, "rollout/score_s": score, "rollout/inflight": 4.0,
            "batch/samples_per_step": 8.0}


def test_steady_state_leaves_out_the_warm_up_and_splits_the_wait():
    steps = [step(9.0, 9.0, 9.0, 1)] * 2 + [step(2.0, 1.0, 0.35, 100)] * 4
    steady = e2e_clock.steady_state(steps, warmup_steps=2)
    assert steady["steps"] == 4
    assert steady["step_s"] == pytest.approx(3.5)
    assert steady["phases_s"] == pytest.approx({"rollout_wait": 2.0, "fwd_bwd": 1.0, "optimizer": 0.1,
                                                "weight_sync": 0.05, "rest": 0.35})
    assert (steady["generation_s"], steady["scoring_s"]) == pytest.approx((1.5, 0.5))
    assert steady["rollout_capacity_s"] == pytest.approx(8 * 1.0 / 4.0)  # 4 in flight of 1 s each: 4 samples/s
    generation, training, limit = e2e_clock.overlap_limit(steady)
    assert (generation, training, limit) == pytest.approx((2.0, 1.5, 3.5 / 2.0))
    with pytest.raises(ValueError, match="leave none"):
        e2e_clock.steady_state(steps, warmup_steps=6)


def test_the_report_compares_async_over_sync_with_the_limit(capsys):
    sync = e2e_clock.steady_state([step(2.0, 1.0, 0.85, 100)] * 3, 0)  # 4 s per step, G=2, T=2: limit 2
    fast = e2e_clock.steady_state([step(0.0, 1.0, 1.6, 100)] * 3, 0)  # 2.75 s per step: 4/2.75 = 1.45x
    report = e2e_clock.steady_report({"sync": [{"steady": sync, "clock": {"steady_tokens_per_s": 100 / 4.0}}],
                                      "async": [{"steady": fast, "clock": {"steady_tokens_per_s": 100 / 2.75}}]})
    assert report["overlap_limit"] == pytest.approx(2.0)
    assert report["steady_async_over_sync"] == pytest.approx(4.0 / 2.75)
    assert report["overlap_efficiency"] == pytest.approx(4.0 / 2.75 / 2.0)
    out = capsys.readouterr().out
    assert "(G + T) / max(G, T) = 2.00x" in out and "efficiency 73% of the limit" in out
    # async: capacity 8 x 1 s / 4 in flight = 2 s, training 2.75 s: bound 2.75 s per step, met at 100 %
    assert report["async_bound_step_s"] == pytest.approx(2.75)
    assert report["async_efficiency_own_bound"] == pytest.approx(1.0)


# One timeline, written out by hand: the process runs 100 → 160 s; the first step starts at 112 s; 8 steps end at
# 114, 117, 119, 121, 123, 125, 127 and 129 s with 50, 60, 70, 80, 90, 100, 110, 120 tokens; k = 3.
START, END, FIRST = 100.0, 160.0, 112.0
ENDS = [114.0, 117.0, 119.0, 121.0, 123.0, 125.0, 127.0, 129.0]
TOKENS = [50, 60, 70, 80, 90, 100, 110, 120]
EXPECTED = {"whole_s": 60.0, "startup_s": 12.0, "fill_s": 7.0, "steady_s": 10.0, "shutdown_s": 31.0, "steps": 8,
            "steady_steps": 5, "trained_tokens": 680, "steady_tokens": 500, "whole_tokens_per_s": 680 / 60.0,
            "steady_tokens_per_s": 500 / 10.0}


def test_the_clock_splits_a_run_into_start_up_fill_steady_state_and_shut_down():
    clock = e2e_clock.run_clock((START, END), FIRST, list(zip(ENDS, TOKENS, strict=True)), warmup_steps=3)
    assert clock == pytest.approx(EXPECTED)
    assert clock["startup_s"] + clock["fill_s"] + clock["steady_s"] + clock["shutdown_s"] == pytest.approx(60.0)
    # k = 0: the steady state starts where the first step does
    clock = e2e_clock.run_clock((START, END), FIRST, list(zip(ENDS, TOKENS, strict=True)), warmup_steps=0)
    assert (clock["fill_s"], clock["steady_s"], clock["steady_tokens_per_s"]) == pytest.approx((0.0, 17.0, 680 / 17))


def test_fastdistill_and_trl_records_of_one_timeline_give_one_clock():
    """fastdistill's metrics.jsonl (log time and perf/step_s per step) and TRL's trl_result.json (train-begin and
    step-end timestamps) describing the same run give the same numbers: the definitions are identical."""
    durations = [end - previous for previous, end in zip([FIRST, *ENDS[:-1]], ENDS, strict=True)]
    fastdistill = [{"time": end, "perf/step_s": seconds, "batch/trained_tokens_per_step": tokens}
                   for end, seconds, tokens in zip(ENDS, durations, TOKENS, strict=True)]
    trl = {"first_step_start": FIRST, "step_ends": ENDS, "step_tokens": TOKENS}
    assert e2e_clock.fastdistill_clock((START, END), fastdistill, 3) == pytest.approx(EXPECTED)
    assert e2e_clock.trl_clock((START, END), trl, 3) == pytest.approx(EXPECTED)


def test_the_clock_refuses_what_it_cannot_measure():
    with pytest.raises(ValueError, match="leave none after 8 warm-up steps"):
        e2e_clock.run_clock((START, END), FIRST, list(zip(ENDS, TOKENS, strict=True)), warmup_steps=8)
    with pytest.raises(ValueError, match=">= 0"):
        e2e_clock.run_clock((START, END), FIRST, list(zip(ENDS, TOKENS, strict=True)), warmup_steps=-1)
    with pytest.raises(ValueError, match="out of order.*index 1 "):  # the first step starts before the process
        e2e_clock.run_clock((START, END), START - 1.0, list(zip(ENDS, TOKENS, strict=True)), warmup_steps=3)
    with pytest.raises(ValueError, match="out of order.*index 10 "):  # the process ends before the last step
        e2e_clock.run_clock((START, 128.0), FIRST, list(zip(ENDS, TOKENS, strict=True)), warmup_steps=3)
    with pytest.raises(ValueError, match="took 0.0 s"):
        e2e_clock.run_clock((START, END), FIRST, [(114.0, 10), (114.0, 10)], warmup_steps=1)
    with pytest.raises(ValueError, match="no step records"):
        e2e_clock.fastdistill_clock((START, END), [], 0)


def contender(clocks, jsds):
    """Runs with the given (steady, whole) tok/s and held-out jsds."""
    return [{"clock": {"steady_tokens_per_s": steady, "whole_tokens_per_s": whole, "startup_s": 1.0, "fill_s": 2.0,
                       "steady_s": 3.0, "shutdown_s": 4.0, "whole_s": 10.0, "steps": 40},
             "held_out_jsd": jsd, "wasted_fraction": 0.0} for (steady, whole), jsd in zip(clocks, jsds, strict=True)]


def test_the_report_gives_paired_ratios_on_both_clocks(capsys):
    results = {"async": contender([(300, 100), (200, 100), (400, 90)], [2.2, 2.0, 2.1]),
               "sync": contender([(100, 50), (100, 80), (100, 30)], [2.0, 2.0, 2.0]),
               "trl": contender([(150, 20), (50, 25), (100, 30)], [2.5, 2.6, 2.7]),
               "async:look1": contender([(120, 60), (130, 60), (140, 60)], [1.9, 2.0, 2.1])}
    report = e2e_clock.clock_report(results, warmup_steps=5)
    assert report["ratios"]["async_over_sync"]["steady"]["each"] == pytest.approx([3.0, 2.0, 4.0])
    assert report["ratios"]["async_over_sync"]["steady"]["median"] == pytest.approx(3.0)
    assert report["ratios"]["async_over_sync"]["whole"]["each"] == pytest.approx([2.0, 1.25, 3.0])
    assert report["ratios"]["async_over_trl"]["steady"]["each"] == pytest.approx([2.0, 4.0, 4.0])
    assert report["ratios"]["async_over_trl"]["whole"]["each"] == pytest.approx([5.0, 4.0, 3.0])
    assert report["ratios"]["async:look1_over_sync"]["steady"]["median"] == pytest.approx(1.3)
    assert (report["ratios"]["async_over_trl"]["steady"]["min"],
            report["ratios"]["async_over_trl"]["steady"]["max"]) == pytest.approx((2.0, 4.0))
    assert report["contenders"]["trl"]["held_out_jsd"]["median"] == pytest.approx(2.6)
    assert report["held_out_jsd_vs_sync"]["async"]["each"] == pytest.approx([0.1, 0.0, 0.05])
    assert report["held_out_jsd_vs_sync"]["async:look1"]["median"] == pytest.approx(0.0)
    out = capsys.readouterr().out
    assert "steady = tokens of steps 6..40 / (end of step 40 - end of step 5)" in out
    assert "async / trl: steady 4.00x (per repeat 2.00, 4.00, 4.00);  whole 4.00x (per repeat 5.00, 4.00, 3.00)" in out
    assert "async vs sync, per repeat: +10.0%, +0.0%, +5.0% (median +5.0%)" in out


def test_a_variant_is_a_name_and_a_mapping_of_config_fields():
    import argparse

    assert bench_e2e.parse_variant("look1={max_lookahead_steps: 1}") == ("look1", {"max_lookahead_steps": 1})
    for bad in ("look1", "1x={seed: 1}", "x=3", "x={}"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_e2e.parse_variant(bad)
