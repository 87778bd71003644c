"""The read-off of a one-call GPU check (``benchmarks/gpu_check.py``'s JSON): whether the compiled kernels are
validated, the validation record of the run when they are, and the RESULTS.md section of the benchmark table.

The record (``kernels/fastdistill_kernels/validated.json``, :mod:`fastdistill_kernels.validation`) is printed, and
written with ``--record``, only when every compiled correctness gate passed on a real GPU from a committed tree: the
check was no dry run, ran a clean checkout (or a copy proven by its stamp), saw a CUDA GPU, every ``test_compiled_*``
kernel test ran and passed (none skipped), every ``ours-*`` row of each benchmark step that ran passed its gate
against the float64 reference, and the kernel tests recorded the keys of the tree that ran and the launch patterns
each design ran (``benchmarks/launch_record.py``). Everything in the record comes from the check's JSON: the module
hashes and triton version computed on the GPU machine, the patterns' verdicts, the commit; nothing of this tree.

    python benchmarks/gpu_results.py benchmarks/results/gpu_check.json                 # verdict + table
    python benchmarks/gpu_results.py gpu_check.json --results benchmarks/RESULTS.md    # and paste the section
    python benchmarks/gpu_results.py gpu_check.json --record                           # and write the record
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VALIDATION_MODULE = ROOT / "kernels" / "fastdistill_kernels" / "validation.py"
FLAG = "KERNELS_VALIDATED_ON_GPU"
SECTION_START = "<!-- gpu-check:start -->"
SECTION_END = "<!-- gpu-check:end -->"
BENCH_STEPS = ("bench-4096", "bench-16384")
GATED_BENCH_STEPS = ("bench-4096",)  # must have run; bench-16384 counts when it ran


def validation_problems(results: dict) -> list[str]:
    """Why the check's results do not validate the compiled kernels (empty: every compiled gate passed on a GPU)."""
    steps = results.get("steps", {})
    out = []
    if results.get("dry_run"):
        out.append("a dry run (no GPU)")
    source = results.get("source") or {}
    if not source.get("clean") or not source.get("commit"):
        out.append("the tree that ran is not a committed one: "
                   + ("; ".join(source.get("dirty", [])[:5]) or "the check recorded no source state"))
    env = steps.get("environment", {})
    if not env.get("gpus"):
        out.append("no GPU seen by nvidia-smi")
    kt = steps.get("kernel-tests", {})
    compiled = kt.get("compiled", {})
    if kt.get("status") != "ok":
        out.append(f"kernel-tests: {kt.get('status', 'not run')}")
    if not compiled.get("tests"):
        out.append("kernel-tests: no compiled-kernel test ran")
    elif compiled.get("passed") != compiled.get("tests"):
        out.append(f"kernel-tests: {compiled.get('passed')} of {compiled.get('tests')} compiled-kernel tests passed "
                   f"({compiled.get('failed', [])[:5]} ...)")
    launches = kt.get("launch_record") or {}
    if not launches.get("run_keys"):
        out.append("kernel-tests: no launch record (the keys of the tree that ran: benchmarks/launch_record.py)")
    elif not any("passed" in v.values() for by in launches.get("patterns", {}).values() for v in by.values()):
        out.append("kernel-tests: no kernel design launched on the GPU in a passing test")
    for name in BENCH_STEPS:
        step = steps.get(name, {})
        if step.get("status") in (None, "skipped"):
            if name in GATED_BENCH_STEPS:
                out.append(f"{name}: not run ({step.get('detail', 'missing')})")
            continue
        ours = [(r, impl, m) for r in step.get("rows", []) for impl, m in r["impls"].items() if impl.startswith("ours")]
        if not ours:
            out.append(f"{name}: no ours-* row")
        for r, impl, m in ours:
            if m.get("status") != "ok" or not m.get("gate", {}).get("ok"):
                out.append(f"{name}: {impl} at N={r['N']} K={r['K']}: {m.get('status')}")
    return out


def validation_module():
    """``fastdistill_kernels.validation``, loaded from this tree by path (it imports nothing of the package, and the
    check's own interpreter need not have the package importable)."""
    spec = importlib.util.spec_from_file_location("fastdistill_kernels_validation", VALIDATION_MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_record(results: dict) -> dict:
    """What the record says about the run: commit, date, machine, software, the compiled tests that passed."""
    steps = results.get("steps", {})
    versions = steps.get("install", {}).get("versions", {})
    compiled = steps.get("kernel-tests", {}).get("compiled", {})
    gpu = (steps.get("environment", {}).get("gpus") or ["?"])[0]
    fields = [f.strip() for f in gpu.split(",")]  # nvidia-smi: name, driver, memory, compute capability
    return {
        "commit": (results.get("source") or {}).get("commit"),
        "date": str(results.get("date", "?"))[:10],
        "machine": gpu,
        "compute_capability": fields[3] if len(fields) == 4 else None,
        "software": ", ".join(f"{k} {versions[k]}" for k in ("python", "torch", "triton") if k in versions),
        "check": "benchmarks/gpu_check.py",
        "compiled_tests": {"passed": compiled.get("passed", 0), "total": compiled.get("tests", 0)},
    }


def validation_record(results: dict) -> dict:
    """The record a passing check writes, from its JSON alone: the keys of the tree that ran and the verdicts of the
    launch patterns its kernel tests ran (``launch_record``), on this run."""
    launches = results["steps"]["kernel-tests"]["launch_record"]
    return validation_module().new_record(run_record(results), launches["run_keys"], launches["patterns"])


def verdict(results: dict) -> str:
    """The lines to print: the new validation record when every compiled gate passed, else why not."""
    problems = validation_problems(results)
    record_file = VALIDATION_MODULE.with_name("validated.json")
    where = record_file.relative_to(ROOT) if record_file.is_relative_to(ROOT) else record_file
    if problems:
        return "\n".join([f"{FLAG} stays as it is ({where} is not rewritten): not every compiled correctness gate "
                          "passed on a GPU:", *(f"  - {p}" for p in problems)])
    gpu = results["steps"]["environment"]["gpus"][0]
    return "\n".join([
        f"Every compiled correctness gate passed on {gpu}. The validation record of this run, for {where} "
        "(`--record` writes it; record the table below in benchmarks/RESULTS.md):",
        json.dumps(validation_record(results), indent=2),
    ])


def _ms(m: dict) -> str:
    """min / median / max of forward + backward in one window (older records: the median of fwd + bwd)."""
    if m.get("status") != "ok":
        return "–"
    s = m.get("spread_s")
    if s:
        return f"{1e3 * s['min']:.1f} / **{1e3 * s['median']:.1f}** / {1e3 * s['max']:.1f}"
    return f"{1e3 * (m['fwd_s'] + m['bwd_s']):.2f}"


def _gate(m: dict) -> str:
    gate = m.get("gate")
    if gate is None:
        return m.get("status", "–")
    worst = max(gate.get("rel_diff", {}).values(), default=float("nan"))
    return f"{'pass' if gate.get('ok') else '**fail**'} ({worst:.1e})"


def _num(x, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "–" if x is None else f"{scale * x:{spec}}{suffix}"


BENCH_HEADER = ["| step | inputs | N | D | V | K | impl | fwd+bwd ms min / **median** / max | fwd / bwd ms | × GEMMs | "
                "predicted ms (measured ÷ predicted) | useful TFLOP/s | MFU: rate / 989 | peak MiB (predicted) | "
                "gate (max rel. diff) |",
                "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]


def _total_s(m: dict) -> float:
    """Median forward + backward seconds of a measured row (older records: median fwd + median bwd)."""
    return m["total_s"] if "total_s" in m else m["fwd_s"] + m["bwd_s"]


def bench_rows(name: str, r: dict, rate: float | None) -> list[str]:
    """The markdown rows of one benchmark configuration: its bare-GEMM floor, then every implementation. Useful
    TFLOP/s and MFU are computed here from the shape (``roofline.useful_flops``) and ``rate`` (FLOP/s, the matmul
    rate measured in the same call), so older records read the same way."""
    head = f"| {name} | {r.get('dist', 'random')} | {r['N']} | {r['D']} | {r['V']} | {r['K']} |"
    lines = []
    floor = r.get("floor")
    if floor:
        pred = r.get("floor_predicted_s")
        lines.append(f"{head} three bare GEMMs | {_ms({'status': 'ok', 'spread_s': floor['total']})} | "
                     f"{1e3 * floor['logits_s']:.1f} + {1e3 * floor['dh_s']:.1f} + {1e3 * floor['dW_s']:.1f} | 1.00 | "
                     f"{_num(pred, '.1f', 1e3)} ({_num(pred and floor['three_s'] / pred, '.2f')}) | | | | |")
    for impl, m in r["impls"].items():
        ok = m.get("status") == "ok"
        if not ok:
            lines.append(f"{head} {impl} | {m.get('status')} | | | | | | | {_gate(m)} |")
            continue
        split = f"{1e3 * m['fwd_s']:.1f} / {1e3 * m['bwd_s']:.1f}"
        x_floor = _num(m.get("x_floor"), ".2f") + (" (4)" if m.get("floor") == "four GEMMs" else "")
        pred = f"{_num(m.get('predicted_s'), '.1f', 1e3)} ({_num(m.get('measured_over_predicted'), '.2f')})"
        if m.get("predicted_s") is None:
            pred = "–"
        useful = roofline.useful_flops(roofline.Shape(r["N"], r["D"], r["V"], r["K"]),
                                       impl in roofline.DENSE_TEACHER_IMPLS) / _total_s(m)
        mfu = (f"{_num(rate and useful / rate, '.0f', 100, '%')} / "
               f"{_num(useful / roofline.DATASHEET_BF16_FLOPS, '.0f', 100, '%')}")
        peak = f"{_num(m.get('peak_mb'), ',.0f')} ({_num(m.get('predicted_peak_mb'), ',.0f')})"
        lines.append(f"{head} {impl} | {_ms(m)} | {split} | {x_floor} | {pred} | {useful / 1e12:.0f} | "
                     f"{mfu} | {peak} | {_gate(m)} |")
    return lines


def bench_table(results: dict) -> str:
    """Markdown: per benchmark configuration and input distribution, the three bare GEMMs (the floor) and each
    implementation: forward + backward time (spread), the split, the ratio to the floor (four GEMMs for a dense
    teacher, marked (4)), the predicted time and measured ÷ predicted, useful TFLOP/s (6·N·D·V, + 2·N·D·V for a dense
    teacher), MFU against the matmul rate measured in the same call and the 989 TFLOP/s datasheet, peak memory beyond
    the inputs beside its prediction, the gate."""
    lines = list(BENCH_HEADER)
    for name in BENCH_STEPS:
        step = results.get("steps", {}).get(name, {})
        tflops = (step.get("machine") or {}).get("bf16_matmul_peak_tflops")
        for r in step.get("rows", []):
            lines.extend(bench_rows(name, r, tflops and tflops * 1e12))
    return "\n".join(lines)


def inputs_lines(results: dict) -> list[str]:
    """One line per benchmark step and distribution: the measured ceilings, and what the inputs look like."""
    out = []
    for name in BENCH_STEPS:
        step = results.get("steps", {}).get(name, {})
        machine = step.get("machine") or {}
        if machine.get("copy_gbytes_per_s"):
            out.append(f"- {name}: {machine.get('rates_source')}; {machine.get('datasheet_bf16_tflops', 989):.0f} "
                       "TFLOP/s datasheet.")
        seen = set()
        for r in step.get("rows", []):
            s, key = r.get("distribution"), (r.get("dist"), r["N"])
            if s and key not in seen:
                seen.add(key)
                out.append(f"- {name} {r.get('dist')} inputs (N={r['N']}): mean entropy {s['mean_entropy_nats']:.2f} "
                           f"nats, {s['tokens_per_row_p_ge_2^-12']:.1f} tokens per row at p ≥ 2⁻¹², mean p_max "
                           f"{s['mean_p_max']:.2f}.")
    return out


SKIP_KEYS = ("status", "cmd", "output_tail", "rows", "summary", "machine", "predicted", "install", "versions",
             "commands", "planned", "counts", "compiled", "rc", "timed_out", "seconds", "notes")


def step_lines(results: dict) -> list[str]:
    """One line per step: status, seconds, and its scalar numbers (any step, future ones included)."""
    out = []
    for name, s in results.get("steps", {}).items():
        facts = {k: v for k, v in s.items() if k not in SKIP_KEYS and isinstance(v, (int, float, str, bool))
                 and v != "" and not (isinstance(v, str) and len(v) > 200)}
        numbers = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in facts.items())
        secs = f" ({s['seconds']:.0f} s)" if isinstance(s.get("seconds"), (int, float)) else ""
        out.append(f"- {name}: **{s.get('status')}**{secs}" + (f"; {numbers}" if numbers else ""))
    return out


def markdown_section(results: dict) -> str:
    """The RESULTS.md section between the gpu-check markers: machine, matmul peak, steps, table, verdict."""
    steps = results.get("steps", {})
    gpus = steps.get("environment", {}).get("gpus") or ["no GPU"]
    machine = next((s.get("machine") for n in BENCH_STEPS if (s := steps.get(n, {})).get("machine")), {})
    peak = machine.get("bf16_matmul_peak_tflops")
    kt = steps.get("kernel-tests", {})
    compiled = kt.get("compiled", {})
    predicted = next((s["predicted"] for n in BENCH_STEPS if (s := steps.get(n, {})).get("predicted")), None)
    return "\n".join([
        SECTION_START,
        f"## One-call GPU check — `benchmarks/gpu_check.py` ({results.get('date', '?')[:10]})",
        "",
        f"GPU: {gpus[0]}. bf16 matmul rate measured in the same call: "
        f"{f'{peak:.0f} TFLOP/s' if peak else '–'} (MFU below: against it / against the 989 TFLOP/s datasheet). "
        f"Versions: {json.dumps(machine.get('versions', {}))}. Whole check {results.get('elapsed_s', '?')} s of a "
        f"{results.get('budget_s', '?')} s budget. Steps:",
        "",
        *step_lines(results),
        "",
        f"Compiled-kernel tests: {compiled.get('passed', 0)} of {compiled.get('tests', 0)} passed "
        f"({kt.get('status', 'not run')}).",
        "",
        *([*inputs, ""] if (inputs := inputs_lines(results)) else []),
        bench_table(results),
        "",
        *([f"Predicted at three lm_heads (`benchmarks/roofline.py`) with {predicted['rates']}:", "",
           predicted_table(predicted["rows"]), ""] if predicted else []),
        "```",
        verdict(results),
        "```",
        SECTION_END,
    ])


def predicted_table(rows: list[dict]) -> str:
    """Markdown of ``roofline.predicted_rows``: predicted ms and × the predicted floor, raw and calibrated by the
    H200's factors (rows of older records have no calibrated fields: –), MFU, peak memory."""
    lines = ["| head | impl | predicted ms: raw / calibrated | × floor: raw / calibrated | MFU: rate / 989 | "
             "peak MiB |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['head']} | {r['impl']} | {r['ms']:.1f} / {_num(r.get('ms_calibrated'), '.1f')} | "
                     f"{r['x_floor']:.2f} / {_num(r.get('x_floor_calibrated'), '.2f')} | "
                     f"{100 * r['mfu_measured_rate']:.0f}% / {100 * r['mfu_datasheet']:.0f}% | {r['peak_mib']:,.0f} |")
    return "\n".join(lines)


def update_results(path: Path, section: str) -> None:
    """Replace the text between the gpu-check markers in ``path`` (append the section if they are absent)."""
    text = path.read_text() if path.exists() else ""
    if SECTION_START in text and SECTION_END in text:
        head, rest = text.split(SECTION_START, 1)
        text = head + section + rest.split(SECTION_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    """Print the verdict and the section for a check's JSON (optionally paste it); 0 when validated, else 1."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", type=Path, help="the JSON gpu_check.py wrote")
    p.add_argument("--results", type=Path, help="replace the gpu-check section of this markdown file")
    p.add_argument("--record", action="store_true", help="write the validation record when every compiled gate "
                   "passed (kernels/fastdistill_kernels/validated.json)")
    args = p.parse_args(argv)
    results = json.loads(args.json.read_text())
    section = markdown_section(results)
    print(section)
    if args.results:
        update_results(args.results, section)
    validated = not validation_problems(results)
    if args.record and validated:
        path = VALIDATION_MODULE.with_name("validated.json")
        path.write_text(json.dumps(validation_record(results), indent=2) + "\n")
        print(f"wrote {path}")
    return 0 if validated else 1


if __name__ == "__main__":
    sys.exit(main())
