"""The one clock of benchmarks/bench_e2e.py and its reports: arithmetic on the timestamps and step records of
finished runs, no servers.

``run_clock`` times every contender (fastdistill async, sync, TRL) alike from wall-clock timestamps: the whole run
(process start to end), the steady state (end of step k to end of the last step, the same k for all), start-up,
fill and shut-down. ``clock_report`` prints both clocks and the paired ratios; ``steady_state``, ``overlap_limit``
and ``steady_report`` break fastdistill's steady-state steps into phases and compare them with the overlap limit.
"""

from __future__ import annotations

import statistics
from typing import Any


def run_clock(process: tuple[float, float], first_step_start: float, steps: list[tuple[float, float]],
              warmup_steps: int) -> dict[str, float]:
    """The one clock of every contender. ``process``: the trainer process's (start, end), ``first_step_start`` and
    ``steps`` (per step in order: (end, trained tokens)) all in wall-clock seconds. Returns the whole run
    (``whole_s``, ``whole_tokens_per_s`` = all tokens / whole_s), the steady state (``steady_s`` = end of the last
    step - end of step ``warmup_steps``, ``steady_tokens_per_s`` = tokens of the steps after it / steady_s) and the
    parts outside it: ``startup_s`` (process start → first step start), ``fill_s`` (→ end of step
    ``warmup_steps``) and ``shutdown_s`` (end of the last step → process end); the four parts sum to whole_s."""
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if len(steps) <= warmup_steps:
        raise ValueError(f"{len(steps)} steps leave none after {warmup_steps} warm-up steps")
    start, end = process
    ends = [moment for moment, _ in steps]
    tokens = [count for _, count in steps]
    moments = [start, first_step_start, *ends, end]
    late = next((i for i in range(1, len(moments)) if moments[i] < moments[i - 1]), None)
    if late is not None:
        raise ValueError(f"timestamps out of order: process start, first step start, step ends, process end = "
                         f"{moments}; the one at index {late} is earlier than the one before it")
    fill_end = ends[warmup_steps - 1] if warmup_steps else first_step_start
    steady_s, whole_s = ends[-1] - fill_end, end - start
    if steady_s <= 0:
        raise ValueError(f"the steady state (steps {warmup_steps + 1}..{len(steps)}) took {steady_s} s")
    return {
        "whole_s": whole_s, "startup_s": first_step_start - start, "fill_s": fill_end - first_step_start,
        "steady_s": steady_s, "shutdown_s": end - ends[-1], "steps": len(steps),
        "steady_steps": len(steps) - warmup_steps, "trained_tokens": sum(tokens),
        "steady_tokens": sum(tokens[warmup_steps:]), "whole_tokens_per_s": sum(tokens) / whole_s,
        "steady_tokens_per_s": sum(tokens[warmup_steps:]) / steady_s,
    }


def fastdistill_clock(process: tuple[float, float], steps: list[dict[str, Any]], warmup_steps: int) -> dict[str, float]:
    """``run_clock`` of a fastdistill run from its ``metrics.jsonl`` records (one per step): a step's record is
    logged at its end (``time``), and the first step began ``perf/step_s`` before its end (the pipeline started)."""
    if not steps:
        raise ValueError("no step records")
    return run_clock(process, steps[0]["time"] - steps[0]["perf/step_s"],
                     [(step["time"], step["batch/trained_tokens_per_step"]) for step in steps], warmup_steps)


def trl_clock(process: tuple[float, float], result: dict[str, Any], warmup_steps: int) -> dict[str, float]:
    """``run_clock`` of a TRL run from its ``trl_result.json`` (``first_step_start``, ``step_ends``,
    ``step_tokens``: see ``e2e_trl_run.py``)."""
    return run_clock(process, result["first_step_start"],
                     list(zip(result["step_ends"], result["step_tokens"], strict=True)), warmup_steps)


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min, max and every value (in run order)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "each": list(values)}


CLOCK_FIELDS = ("steady_tokens_per_s", "whole_tokens_per_s", "startup_s", "fill_s", "steady_s", "shutdown_s",
                "whole_s")


def clock_report(results: dict[str, list[dict[str, Any]]], warmup_steps: int) -> dict[str, Any]:
    """Print both clocks for every contender (medians over repeats; start-up, fill and shut-down beside them), the
    paired ratios of every asynchronous contender over ``sync`` and ``trl`` on both clocks (median of the
    per-repeat ratios, with their range) and the held-out jsd (median, range; relative to sync per repeat).
    Returns those numbers: ``contenders`` (name → field → ``spread``), ``ratios`` (e.g. ``async_over_trl`` →
    ``steady``/``whole`` → ``spread``) and ``held_out_jsd_vs_sync`` (name → ``spread`` of the relative
    differences)."""
    contenders = {name: {**{field: spread([run["clock"][field] for run in runs]) for field in CLOCK_FIELDS},
                         "held_out_jsd": spread([run["held_out_jsd"] for run in runs]),
                         "wasted_fraction": spread([run["wasted_fraction"] for run in runs])}
                  for name, runs in results.items()}
    steps = next(iter(results.values()))[0]["clock"]["steps"]
    print(f"\nOne clock for every contender, medians over repeats (seconds on the wall clock of the trainer process):"
          f"\n  steady = tokens of steps {warmup_steps + 1}..{steps} / (end of step {steps} - end of step "
          f"{warmup_steps});  whole = all tokens / (process end - process start)"
          f"\n  start-up = process start -> first step start (imports, models, servers connected, cold weight sync,"
          f" worker started); fill = steps 1..{warmup_steps};"
          f"\n  shut-down = end of the last step -> process end (final model export, pipeline stop, exit)")
    print(f"{'run':<14}{'steady tok/s':>13}{'whole tok/s':>12}{'start-up s':>11}{'fill s':>8}{'steady s':>9}"
          f"{'shut-down s':>12}{'whole s':>9}{'held-out jsd':>13}{'wasted':>8}")
    for name, row in contenders.items():
        print(f"{name:<14}" + "".join(f"{row[field]['median']:>{width}.{digits}f}" for field, width, digits in (
            ("steady_tokens_per_s", 13, 1), ("whole_tokens_per_s", 12, 1), ("startup_s", 11, 2), ("fill_s", 8, 2),
            ("steady_s", 9, 2), ("shutdown_s", 12, 2), ("whole_s", 9, 1), ("held_out_jsd", 13, 3)))
              + f"{row['wasted_fraction']['median']:>8.1%}")
    ratios: dict[str, Any] = {}
    fast = [name for name in results if name == "async" or name.startswith("async:")]
    for name in fast:
        for other in ("sync", "trl"):
            if other not in results:
                continue
            pairs = list(zip(results[name], results[other], strict=True))
            entry = {clock: spread([a["clock"][f"{clock}_tokens_per_s"] / b["clock"][f"{clock}_tokens_per_s"]
                                    for a, b in pairs]) for clock in ("steady", "whole")}
            ratios[f"{name}_over_{other}"] = entry
            print(f"{name} / {other}: " + ";  ".join(
                f"{clock} {entry[clock]['median']:.2f}x (per repeat "
                f"{', '.join(f'{r:.2f}' for r in entry[clock]['each'])})" for clock in ("steady", "whole")))
    jsd_vs_sync: dict[str, Any] = {}
    print("held-out jsd (lower is better), median (range): " + ";  ".join(
        f"{name} {jsd['median']:.3f} ({jsd['min']:.3f}-{jsd['max']:.3f})"
        for name, jsd in ((name, row["held_out_jsd"]) for name, row in contenders.items())))
    if "sync" in results:
        for name in fast:
            relative = [a["held_out_jsd"] / b["held_out_jsd"] - 1.0
                        for a, b in zip(results[name], results["sync"], strict=True)]
            jsd_vs_sync[name] = spread(relative)
            print(f"  {name} vs sync, per repeat: {', '.join(f'{r:+.1%}' for r in relative)} (median "
                  f"{statistics.median(relative):+.1%})")
    return {"contenders": contenders, "ratios": ratios, "held_out_jsd_vs_sync": jsd_vs_sync}


STEADY_PHASES = ("rollout_wait", "fwd_bwd", "optimizer", "weight_sync")


def steady_state(steps: list[dict[str, Any]], warmup_steps: int) -> dict[str, Any]:
    """Steady-state phases of one fastdistill run from its per-step records (``metrics.jsonl``, logging every step)
    past the first ``warmup_steps``: seconds per step of each phase of ``STEADY_PHASES`` (``perf/<phase>_s``) and
    ``rest`` (the step's other seconds), generation and scoring seconds per step (the rollout wait split by the
    worker's mean ``rollout/score_s`` / ``rollout/duration_s``; meaningful where the trainer waits for whole waves,
    the synchronous mode) and the rollout capacity per step (Little's law). Its throughput is the clock's
    (``run_clock``)."""
    kept = steps[warmup_steps:]
    if not kept:
        raise ValueError(f"{len(steps)} steps leave none after {warmup_steps} warm-up steps")
    seconds = sum(step["perf/step_s"] for step in kept)
    phases = {name: sum(step.get(f"perf/{name}_s", 0.0) for step in kept) / len(kept) for name in STEADY_PHASES}
    phases["rest"] = seconds / len(kept) - sum(phases.values())
    durations = [step["rollout/duration_s"] for step in kept if step.get("rollout/duration_s")]
    scoring = [step.get("rollout/score_s", 0.0) for step in kept if step.get("rollout/duration_s")]
    score_share = sum(scoring) / sum(durations) if durations else 0.0
    # Little's law: rollouts finish at (in flight) / (duration) per second, so a step's samples take this long to
    # generate and score at the pipeline's depth; the bound of a run is max(that, the step's training)
    inflight = [step["rollout/inflight"] for step in kept if step.get("rollout/inflight")]
    samples = sum(step.get("batch/samples_per_step", 0.0) for step in kept) / len(kept)
    mean_duration = sum(durations) / len(durations) if durations else 0.0
    capacity_s = samples * mean_duration / (sum(inflight) / len(inflight)) if inflight else None
    return {
        "rollout_capacity_s": capacity_s,
        "steps": len(kept),
        "step_s": seconds / len(kept),
        "phases_s": phases,
        "generation_s": phases["rollout_wait"] * (1.0 - score_share),
        "scoring_s": phases["rollout_wait"] * score_share,
    }


def overlap_limit(sync_steady: dict[str, Any]) -> tuple[float, float, float]:
    """(G, T, limit) from a synchronous run's steady state: G = generation + scoring seconds per step (the rollout
    wait), T = the rest of the step (training, weight sync, bookkeeping); limit = (G + T) / max(G, T), the best
    async/sync throughput ratio that overlapping the two can give."""
    generation = sync_steady["phases_s"]["rollout_wait"]
    training = sync_steady["step_s"] - generation
    return generation, training, (generation + training) / max(generation, training, 1e-12)


def steady_report(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Print the steady-state phase table of fastdistill's modes (medians over repeats, per mode: the clock's steady
    tok/s and seconds per step of each phase) and, with both modes, the overlap limit from the synchronous run's
    phases beside the measured steady async/sync (the median of the repeats' paired ratios) and their quotient, the
    efficiency. Returns those numbers."""
    modes = [name for name in ("async", "sync") if name in results]
    if not modes:
        return {}
    report: dict[str, Any] = {}
    print("\nSteady-state phases (the clock's steady window), medians over repeats, seconds per step")
    columns = ("tok/s", "step", "gen", "score", *STEADY_PHASES[1:], "rest")
    print(f"{'mode':<7}" + "".join(f"{c:>12}" for c in columns) + "   (gen + score = rollout wait)")
    for name in modes:
        runs = results[name]

        def median(get, runs=runs):
            return statistics.median(get(run) for run in runs)

        row = {"trained_tokens_per_s": median(lambda r: r["clock"]["steady_tokens_per_s"]),
               "step_s": median(lambda r: r["steady"]["step_s"]),
               "generation_s": median(lambda r: r["steady"]["generation_s"]),
               "scoring_s": median(lambda r: r["steady"]["scoring_s"]),
               **{f"{p}_s": median(lambda r, p=p: r["steady"]["phases_s"][p]) for p in (*STEADY_PHASES, "rest")}}
        report[f"{name}_steady"] = row
        cells = [row["trained_tokens_per_s"], row["step_s"], row["generation_s"], row["scoring_s"],
                 *(row[f"{p}_s"] for p in STEADY_PHASES[1:]), row["rest_s"]]
        print(f"{name:<7}" + "".join(f"{c:>12.3f}" for c in cells))
    if len(modes) == 2:
        limits = [overlap_limit(run["steady"]) for run in results["sync"]]
        paired = [a["clock"]["steady_tokens_per_s"] / b["clock"]["steady_tokens_per_s"]
                  for a, b in zip(results["async"], results["sync"], strict=True)]
        efficiency = [ratio / limit[2] for ratio, limit in zip(paired, limits, strict=True)]
        generation, training = (statistics.median(limit[i] for limit in limits) for i in (0, 1))
        report.update({"sync_generation_per_step_s": generation, "sync_training_per_step_s": training,
                       "overlap_limit": statistics.median(limit[2] for limit in limits),
                       "steady_async_over_sync": statistics.median(paired),
                       "steady_async_over_sync_per_repeat": paired,
                       "overlap_efficiency": statistics.median(efficiency),
                       "overlap_efficiency_per_repeat": efficiency})
        print(f"overlap limit from the sync run: G = {generation:.3f} s (generation + scoring), T = {training:.3f} s "
              f"(the rest of the step) per step -> (G + T) / max(G, T) = {report['overlap_limit']:.2f}x")
        bounds = [max(run["steady"]["rollout_capacity_s"] or 0.0,
                      run["steady"]["step_s"] - run["steady"]["phases_s"]["rollout_wait"]) for run in results["async"]]
        own = [bound / run["steady"]["step_s"] for bound, run in zip(bounds, results["async"], strict=True)]
        report.update({"async_bound_step_s": statistics.median(bounds), "async_efficiency_own_bound":
                       statistics.median(own)})
        print(f"async's own bound: max(rollout capacity = samples/step x rollout duration / rollouts in flight, "
              f"training) = {report['async_bound_step_s']:.3f} s per step; async runs at "
              f"{report['async_efficiency_own_bound']:.0%} of it")
        print(f"steady async / sync: {report['steady_async_over_sync']:.2f}x -> efficiency "
              f"{report['overlap_efficiency']:.0%} of the limit (per repeat: "
              f"{', '.join(f'{e:.0%}' for e in efficiency)})")
    return report
