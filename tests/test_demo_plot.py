"""The demo's figure: legends clear of every plotting area and of each other, smoothed lines over the raw ones."""

from __future__ import annotations

import math
import random

import pytest

from fastdistill.demo import curves_figure, smoothed


def _history(steps: int = 60, seed: int = 0) -> list[dict[str, float]]:
    rng = random.Random(seed)
    history = []
    for step in range(1, steps + 1):
        history.append({"step": step, "jsd": 2.0 / step + 0.01, "perf/trained_tok_s_wall_clock": 300 + rng.gauss(0, 80),
                        "sample/staleness_mean": max(0.0, 1.5 + rng.gauss(0, 1.0))})
        if step % 10 == 0:
            history.append({"step": step, "eval/jsd": 2.0 / step, "eval/exact_match": step / steps})
    return history


def test_smoothed_is_a_centred_moving_average_that_skips_nan():
    values = [1.0, 2.0, float("nan"), 4.0, 5.0, 6.0]
    # window 3: the mean of each point and its neighbours that exist and are numbers
    assert smoothed(values, window=3) == pytest.approx([1.5, 1.5, 3.0, 4.5, 5.0, 5.5])
    assert math.isnan(smoothed([float("nan")] * 3, window=3)[1])
    assert smoothed([], window=5) == []


def test_smoothing_takes_out_the_per_step_noise():
    rng = random.Random(1)
    noisy = [rng.gauss(0, 1) for _ in range(400)]
    line = smoothed(noisy, window=9)
    var = sum(v * v for v in noisy) / len(noisy)
    var_line = sum(v * v for v in line) / len(line)
    # a mean of 9 independent unit-variance points has variance 1/9; allow the sampling spread of 400 points
    assert var_line < var / 4


def test_every_legend_is_clear_of_the_data_and_of_each_other():
    import matplotlib.pyplot as plt

    figure = curves_figure(_history(), teacher_accuracy=0.9)
    try:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        axes = figure.axes  # three panels and the staleness twin
        legends = [ax.get_legend() for ax in axes if ax.get_legend() is not None]
        assert len(legends) == 3  # one per panel: the twin's lines share the third panel's legend
        third = figure.axes[2].get_legend()
        assert {t.get_text() for t in third.get_texts()} == {"trained tokens/s (smoothed)",
                                                            "mean staleness, optimizer steps (smoothed)"}
        boxes = [legend.get_window_extent(renderer) for legend in legends]
        for box in boxes:
            for ax in axes:
                assert not box.overlaps(ax.get_window_extent(renderer)), "a legend covers a plotting area"
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not a.overlaps(b)
        # the raw per-step lines are drawn faint under their smoothed lines
        raw = [line for ax in axes[2:] for line in ax.get_lines() if line.get_alpha() is not None]
        assert len(raw) == 2 and all(line.get_alpha() < 0.5 for line in raw)
    finally:
        plt.close(figure)
