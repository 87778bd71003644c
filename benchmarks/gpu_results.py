"""The read-off of a one-call GPU check (``benchmarks/gpu_check.py``'s JSON): whether the compiled kernels are
validated, the exact line to change when they are, and the RESULTS.md section of the benchmark table.

``KERNELS_VALIDATED_ON_GPU`` may flip only when every compiled correctness gate passed on a real GPU: the check was
no dry run, saw a CUDA GPU, every ``test_compiled_*`` kernel test ran and passed (none skipped), and every ``ours-*``
row of each benchmark step that ran passed its correctness gate against the float64 reference.

    python benchmarks/gpu_results.py benchmarks/results/gpu_check.json                 # verdict + table
    python benchmarks/gpu_results.py gpu_check.json --results benchmarks/RESULTS.md    # and paste the section
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAG_FILE = ROOT / "kernels" / "fastdistill_kernels" / "__init__.py"
FLAG_TEST = ROOT / "tests" / "test_kernels.py"
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


def flag_line() -> tuple[int, str]:
    """``(line number, text)`` of the flag's assignment in its source file."""
    for i, line in enumerate(FLAG_FILE.read_text().splitlines(), 1):
        if re.match(rf"{FLAG}\s*=", line):
            return i, line
    raise LookupError(f"{FLAG} = ... not found in {FLAG_FILE}")


def verdict(results: dict) -> str:
    """The lines to print: the exact change to make when the kernels are validated, else why not."""
    problems = validation_problems(results)
    number, line = flag_line()
    where = f"{FLAG_FILE.relative_to(ROOT)}:{number}"
    if problems:
        return "\n".join([f"{FLAG} stays as it is ({where}: {line.strip()}): not every compiled correctness gate "
                          "passed on a GPU:", *(f"  - {p}" for p in problems)])
    gpu = results["steps"]["environment"]["gpus"][0]
    return "\n".join([
        f"Every compiled correctness gate passed on {gpu}. Change {where}:",
        f"  - {line.strip()}",
        f"  + {FLAG} = True",
        f"and in {FLAG_TEST.relative_to(ROOT)} replace test_the_kernels_are_not_marked_validated_yet's "
        f"`is False` with `is True`; record the table below in benchmarks/RESULTS.md.",
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


def markdown_section(results: dict) -> str:
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
        verdict(results),
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
    args = p.parse_args(argv)
    results = json.loads(args.json.read_text())
    section = markdown_section(results)
    print(section)
    if args.results:
        update_results(args.results, section)
    return 0 if not validation_problems(results) else 1


if __name__ == "__main__":
    sys.exit(main())
