"""benchmarks/roofline.py reads its chunk rows, row blocks and tiles off the kernels' and the torch path's own
functions (so the model cannot drift from them), and prints every prediction raw and calibrated by the H200's
measured ÷ predicted factors; benchmarks/train_step_predict.py does the same per phase."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
pytest.importorskip("triton")

import roofline  # noqa: E402
import train_step_predict  # noqa: E402
from fastdistill_kernels import backward, dense_chunk, logits_chunk  # noqa: E402
from fastdistill_kernels.config import DENSE_TILES, TileConfig  # noqa: E402

from fastdistill.loss import chunked as torch_path  # noqa: E402

SHAPES = [*roofline.HEADS.values(), roofline.Shape(300, 64, 1000), roofline.Shape(100000, 8192, 256000),
          roofline.Shape(5000, 2048, 32000, D_t=1024, V_t=32064)]


@pytest.mark.parametrize("s", SHAPES, ids=str)
def test_the_models_sizes_are_the_codes(s):
    assert roofline.fp32_chunk_rows(s) == logits_chunk.chunk_rows_for(s.N, s.V)
    assert roofline.fp32_chunk_rows(s, True) == dense_chunk.dense_chunk_rows_for(s.N, s.V, s.teacher[1])
    assert roofline.fp32_chunk_row_bytes(s, True) == dense_chunk.dense_chunk_row_bytes(s.V, s.teacher[1])
    for dense, cfg in ((False, TileConfig()), (True, DENSE_TILES[(True, False)])):
        rows, tiles = backward.deterministic_blocks(cfg, s.N, s.D, math.ceil(s.V / cfg.block_vocab), s.elem_bytes)
        assert roofline.deterministic_blocks(s, dense) == (rows, tiles * cfg.block_vocab)
    c = torch_path.default_chunk_rows(s.V, torch.float32, on_gpu=True)
    assert roofline.torch_chunk_rows(s) == (min(s.N, c), torch_path.scratch_rows(s.V, torch.float32, on_gpu=True))


def test_the_model_calls_the_kernels_functions(monkeypatch):
    """A change in the kernels' host sizing shows up in the model: it calls their functions, it holds no copy."""
    s = roofline.HEADS["Qwen2.5-7B"]
    code = roofline.kernel_code()
    before = (roofline.chunked(s).note, roofline.no_logits(s).note, roofline.torch_path(s).note)
    monkeypatch.setattr(code.logits_chunk, "chunk_rows_for", lambda n, v: 1000)
    monkeypatch.setattr(code.backward, "deterministic_blocks", lambda cfg, n, d, tiles, elem: (n, tiles))
    monkeypatch.setattr(code.torch_path, "default_chunk_rows", lambda v, dtype, on_gpu: 512)
    after = (roofline.chunked(s).note, roofline.no_logits(s).note, roofline.torch_path(s).note)
    assert after == ("C=1000, 17 chunks", "1 row blocks × 1 vocabulary chunks", "c=512, 32 chunks") != before
    monkeypatch.setattr(code.config, "TileConfig", lambda: TileConfig(block_rows=64, block_vocab=256))
    assert roofline.deterministic_blocks(s) == (s.N, math.ceil(s.V / 256) * 256)


def test_a_factor_is_the_h200_measurement_over_the_model():
    """Recomputed by hand for the three bare GEMMs (pure matmul: 6·N·D·V at the recorded rate)."""
    (gemms,) = [m for m in roofline.H200_MEASURED if m.design == "gemms"]
    s = roofline.HEADS[gemms.head]
    predicted_ms = 1e3 * 6 * s.N * s.D * s.V / (gemms.matmul_tflops * 1e12)
    assert roofline.calibration_factor("gemms") == pytest.approx(gemms.ms / predicted_ms)
    assert roofline.calibration_factor("gemms-dense") == roofline.calibration_factor("gemms")
    # the current designs take their 17cb676 version's factor, at their head when the H200 measured it there
    for m in roofline.H200_MEASURED:
        assert roofline.measured_over_predicted(m) > 1.0  # every design ran slower than its raw prediction
    assert roofline.calibration_factor("ours-chunked", "Qwen2.5-0.5B") != roofline.calibration_factor("ours-chunked")
    assert roofline.calibration_factor("ours-dense", "Qwen2.5-0.5B") == roofline.calibration_factor("ours-dense")
    assert roofline.calibration_factor("trl") is None


def test_every_predicted_row_is_printed_raw_and_calibrated():
    rows = roofline.predicted_rows(roofline.HEADS, roofline.H200_RECORDED)
    by = {(r["head"], r["impl"]): r for r in rows}
    for r in rows:
        assert r["ms_calibrated"] == pytest.approx(r["ms"] * roofline.calibration_factor(r["impl"], r["head"]))
        floor = by[(r["head"], roofline.floor_of(r["impl"]))]
        assert r["x_floor_calibrated"] == pytest.approx(r["ms_calibrated"] / floor["ms_calibrated"])
    text = roofline.predicted_markdown(rows, roofline.H200_RECORDED)
    r = by[("Qwen2.5-7B", "ours-chunked")]
    assert f"| {r['ms']:.1f} / **{r['ms_calibrated']:.1f}** ({r['factor']:.2f}) |" in text
    # and the GPU check's read-off prints both
    import gpu_results

    table = gpu_results.predicted_table(rows)
    assert f"| Qwen2.5-7B | ours-chunked | {r['ms']:.1f} / {r['ms_calibrated']:.1f} |" in table


def test_the_step_prediction_is_raw_and_calibrated():
    row = train_step_predict.typical_row()
    for shape in train_step_predict.TOP_K_SHAPES:
        phases = train_step_predict.predict(shape, row)
        gemms = roofline.calibration_factor("gemms")
        assert phases["backbone_fwd"]["ms_calibrated"] == pytest.approx(phases["backbone_fwd"]["ms"] * gemms)
        head = train_step_predict.CALIBRATION_HEADS.get(shape)
        torch_loss = phases[train_step_predict.LOSS_TORCH]
        assert torch_loss["ms_calibrated"] == pytest.approx(torch_loss["ms"]
                                                            * roofline.calibration_factor("torch", head))
        args = (row["forwarded"], row["trained"], row["pairs"])
        for design, name in train_step_predict.DESIGN_ROWS.items():
            step = train_step_predict.predicted_step_ms(shape, design, *args, calibrated=True)
            common = sum(p["ms_calibrated"] for n, p in phases.items() if not n.startswith("loss"))
            assert step == pytest.approx(common + phases[name]["ms_calibrated"])
            assert step > train_step_predict.predicted_step_ms(shape, design, *args)
    assert "| qwen2.5-1.5b | step with loss: torch | | | " in train_step_predict.prediction_table()


def test_roofline_and_the_read_off_import_without_torch():
    """The GPU check's bootstrap interpreter (no torch, no triton) imports gpu_results, hence roofline: the kernels'
    functions load only when a design's sizing is asked for."""
    import subprocess

    code = ("import sys; sys.modules['torch'] = None; sys.modules['triton'] = None; "
            f"sys.path.insert(0, {str(BENCH)!r}); import gpu_results, roofline; "
            "print(roofline.useful_flops(roofline.Shape(2, 3, 5)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "180.0", proc.stderr[-2000:]


def test_the_prose_states_the_kernels_chunk_budget():
    """The chunked design's buffer budget as the docstrings and docs state it is the kernels' DEFAULT_CHUNK_BYTES."""
    from fastdistill.loss import api

    mib = logits_chunk.DEFAULT_CHUNK_BYTES // 2**20
    assert f"within {mib} MiB" in api.sparse_jsd_loss.__doc__
    docs = (BENCH.parent / "docs" / "loss.md").read_text()
    assert f"fp32 buffers within {mib} MiB" in docs and "2 GiB" not in api.sparse_jsd_loss.__doc__
