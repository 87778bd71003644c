"""The read-off of a one-call GPU check (``benchmarks/gpu_check.py``'s JSON): whether the compiled kernels are
validated, the validation record of the run when they are, and the RESULTS.md section of the benchmark table.

The record (``kernels/fastdistill_kernels/validated.json``, :mod:`fastdistill_kernels.validation`: per design the
sha256 of each kernel's source, and the run: commit, date, machine, compiled tests) is printed, and written with
``--record``, only when every compiled correctness gate passed on a real GPU: the check was no dry run, saw a CUDA
GPU, every ``test_compiled_*`` kernel test ran and passed (none skipped), and every ``ours-*`` row of each benchmark
step that ran passed its correctness gate against the float64 reference. The hashes are those the check recorded
(``kernel_hashes`` in its JSON) or, without them, those of this source tree, which must then be the tree that ran.

    python benchmarks/gpu_results.py benchmarks/results/gpu_check.json                 # verdict + table
    python benchmarks/gpu_results.py gpu_check.json --results benchmarks/RESULTS.md    # and paste the section
    python benchmarks/gpu_results.py gpu_check.json --record --commit abc1234          # and write the record
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

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
    spec.loader.exec_module(module)
    return module


def source_commit() -> str:
    """This tree's commit (short), ``+changes`` when the kernels differ from it, or ``unknown`` without git."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "kernels"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def run_record(results: dict, commit: str | None = None) -> dict:
    """What the record says about the run: commit, date, machine, software, the compiled tests that passed."""
    steps = results.get("steps", {})
    versions = steps.get("install", {}).get("versions", {})
    compiled = steps.get("kernel-tests", {}).get("compiled", {})
    return {
        "commit": commit or results.get("commit") or source_commit(),
        "date": str(results.get("date", "?"))[:10],
        "machine": (steps.get("environment", {}).get("gpus") or ["?"])[0],
        "software": ", ".join(f"{k} {versions[k]}" for k in ("python", "torch", "triton") if k in versions),
        "check": "benchmarks/gpu_check.py",
        "compiled_tests": {"passed": compiled.get("passed", 0), "total": compiled.get("tests", 0)},
    }


def validation_record(results: dict, commit: str | None = None) -> dict:
    """The record a passing check writes: every design's kernel hashes (the check's, else this tree's) on this run."""
    validation = validation_module()
    return validation.new_record(run_record(results, commit), results.get("kernel_hashes"))


def verdict(results: dict, commit: str | None = None) -> str:
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
        json.dumps(validation_record(results, commit), indent=2),
    ])


def _ms(m: dict) -> str:
    return f"{1e3 * (m['fwd_s'] + m['bwd_s']):.2f}" if m.get("status") == "ok" else "–"


def _gate(m: dict) -> str:
    gate = m.get("gate")
    if gate is None:
        return m.get("status", "–")
    worst = max(gate.get("rel_diff", {}).values(), default=float("nan"))
    return f"{'pass' if gate.get('ok') else '**fail**'} ({worst:.1e})"


def bench_table(results: dict) -> str:
    """Markdown: one row per benchmark configuration and implementation — forward + backward time, peak memory
    beyond the inputs, TFLOP/s (8·N·D·V), MFU against the bf16 matmul rate measured in the same call, the gate."""
    lines = ["| step | N | D | V | K | impl | fwd+bwd ms | peak MB | TFLOP/s | MFU | gate (max rel. diff) |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for name in BENCH_STEPS:
        step = results.get("steps", {}).get(name, {})
        for r in step.get("rows", []):
            for impl, m in r["impls"].items():
                ok = m.get("status") == "ok"
                peak = f"{m['peak_mb']:.0f}" if ok and m.get("peak_mb") is not None else "–"
                tf = f"{m['tflops']:.1f}" if ok and m.get("tflops") else "–"
                mfu = f"{100 * m['mfu']:.1f}%" if ok and m.get("mfu") else "–"
                lines.append(f"| {name} | {r['N']} | {r['D']} | {r['V']} | {r['K']} | {impl} | {_ms(m)} | {peak} | "
                             f"{tf} | {mfu} | {_gate(m)} |")
    return "\n".join(lines)


def markdown_section(results: dict, commit: str | None = None) -> str:
    """The RESULTS.md section between the gpu-check markers: machine, matmul peak, steps, table, verdict."""
    steps = results.get("steps", {})
    gpus = steps.get("environment", {}).get("gpus") or ["no GPU"]
    machine = next((s.get("machine") for n in BENCH_STEPS if (s := steps.get(n, {})).get("machine")), {})
    peak = machine.get("bf16_matmul_peak_tflops")
    kt = steps.get("kernel-tests", {})
    compiled = kt.get("compiled", {})
    step_line = ", ".join(f"{n} {s['status']}" + (f" ({s['seconds']:.0f} s)" if s.get("seconds") else "")
                          for n, s in steps.items())
    return "\n".join([
        SECTION_START,
        f"## One-call GPU check — `benchmarks/gpu_check.py` ({results.get('date', '?')[:10]})",
        "",
        f"GPU: {gpus[0]}. bf16 matmul rate measured in the same call: "
        f"{f'{peak:.0f} TFLOP/s' if peak else '–'} (MFU below is against it). Versions: "
        f"{json.dumps(machine.get('versions', {}))}. Whole check {results.get('elapsed_s', '?')} s of a "
        f"{results.get('budget_s', '?')} s budget; steps: {step_line}.",
        "",
        f"Compiled-kernel tests: {compiled.get('passed', 0)} of {compiled.get('tests', 0)} passed "
        f"({kt.get('status', 'not run')}).",
        "",
        bench_table(results),
        "",
        "```",
        verdict(results, commit),
        "```",
        SECTION_END,
    ])


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
    p.add_argument("--commit", help="the commit the check ran (default: the JSON's, else this tree's)")
    args = p.parse_args(argv)
    results = json.loads(args.json.read_text())
    section = markdown_section(results, args.commit)
    print(section)
    if args.results:
        update_results(args.results, section)
    validated = not validation_problems(results)
    if args.record and validated:
        path = VALIDATION_MODULE.with_name("validated.json")
        path.write_text(json.dumps(validation_record(results, args.commit), indent=2) + "\n")
        print(f"wrote {path}")
    return 0 if validated else 1


if __name__ == "__main__":
    sys.exit(main())
