"""Build the device kit: the wheels one GPU-check call carries to a machine that has no network.

The lent GPU machine runs its own image (Python 3.12, torch 2.11 + CUDA 13, triton 3.6, transformers 5.17, numpy,
pandas, pyarrow, accelerate, pytest, hypothesis, ...) and reaches no package index; one call carries at most 64 MiB.
So the check runs on that image as it is, and the kit holds only what the check needs and the image lacks:
TRL 1.16.0, Liger, Cut Cross-Entropy (the benchmark's contenders), ``datasets`` with its two missing dependencies
(TRL imports it) and ``msgspec`` (fastdistill's own dependency the image lacks: the trainer imports it).
``pip download --no-deps --only-binary=:all:`` fetches them for the image's interpreter (``--python-version 3.12
--implementation cp`` and the manylinux x86_64 tags a wheel may carry); the check installs them with ``pip install
--no-index --no-deps --target`` (``benchmarks/gpu_check.py --kit``).

Not carried, each for its reason (the check reports their steps as skipped): vLLM (gigabytes of CUDA wheels that pin
their own torch), flash-attn (no wheel on PyPI; it is built against one torch and CUDA), ``kernels`` (the HF kernel
loader: no check step uses it, and it needs sigstore and its dependency tree).

    python benchmarks/device_kit.py --out build/device-kit                          # for the GPU image (cp312)
    python benchmarks/device_kit.py --out build/device-kit-py311 --python-version 3.11   # the CPU rehearsal's
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

# What the check needs and the image lacks, pinned: the versions the CPU suite runs against.
KIT_PACKAGES = {
    "trl": "1.16.0",
    "liger-kernel": "0.8.5",
    "cut-cross-entropy": "25.1.1",
    "datasets": "5.2.0",  # TRL's trainers import it; its other dependencies are on the image
    "dill": "0.4.1",  # datasets: dill<0.4.2
    "multiprocess": "0.70.19",  # datasets: multiprocess<0.70.20
    "msgspec": "0.23.0",  # fastdistill imports it (the rollout decoder, under fastdistill.train): the train-step step
}
NOT_CARRIED = {
    "vllm": "gigabytes of CUDA wheels pinning their own torch: far over the 64 MiB one call carries",
    "flash-attn": "no wheel on PyPI (built against one torch and CUDA release); the image has none",
    "kernels": "the HF kernel loader: no check step needs it (it pulls sigstore and its dependency tree)",
}
IMAGE_PYTHON = "3.12"
# The tags a manylinux x86_64 wheel may carry; pip matches each manylinux_2_N exactly.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "any")
CALL_LIMIT_BYTES = 64 * 2**20  # what one device call may carry, the working tree included
KIT_LIMIT_BYTES = 16 * 2**20  # the kit's own ceiling: leaves the rest of the call to the source tree
MANIFEST = "MANIFEST.json"


def download_command(out: Path, python_version: str, packages: dict[str, str]) -> list[str]:
    """The ``pip download`` that fetches ``packages`` (name -> version) as wheels for a CPython ``python_version``
    on manylinux x86_64 into ``out``, and nothing else (no dependencies, no source builds)."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return [*cmd, "--dest", str(out), *(f"{name}=={version}" for name, version in packages.items())]


def wheel_requirements(path: Path) -> list[str]:
    """The unconditional ``Requires-Dist`` lines of a wheel (extras left out)."""
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(name).decode())
    return [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]


def manifest(out: Path, python_version: str) -> dict:
    """What the kit folder holds: wheels with sizes and declared requirements, the total, the limits."""
    wheels = sorted(out.glob("*.whl"))
    names = [w.name.split("-")[0].lower().replace("_", "-") for w in wheels]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    total = sum(w.stat().st_size for w in wheels)
    return {"python_version": python_version, "platforms": list(PLATFORMS), "total_bytes": total,
            "total_mib": round(total / 2**20, 2), "limit_bytes": KIT_LIMIT_BYTES, "duplicated": duplicated,
            "wheels": [{"file": w.name, "bytes": w.stat().st_size, "requires": wheel_requirements(w)}
                       for w in wheels],
            "not_carried": NOT_CARRIED}


def kit_problems(info: dict, packages: dict[str, str]) -> list[str]:
    """Why a kit is unusable: a package missing, two versions of one (pip refuses the install), over its size."""
    have = {w["file"].split("-")[0].lower().replace("_", "-"): w["file"].split("-")[1] for w in info["wheels"]}
    out = [f"{name}=={version} is missing" for name, version in packages.items()
           if have.get(name.replace("_", "-")) != version]
    out += [f"{name} is there in two versions" for name in info["duplicated"]]
    if info["total_bytes"] > info["limit_bytes"]:
        out.append(f"{info['total_mib']} MiB is over the kit's {info['limit_bytes'] / 2**20:.0f} MiB")
    return out


def build(out: Path, python_version: str = IMAGE_PYTHON, packages: dict[str, str] | None = None) -> dict:
    """Download the kit into ``out`` (wheels already there are kept), write its manifest and return it; raises
    RuntimeError with pip's output, or with :func:`kit_problems`, when the kit cannot be built as asked."""
    packages = KIT_PACKAGES if packages is None else packages
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(download_command(out, python_version, packages), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    info = manifest(out, python_version)
    problems = kit_problems(info, packages)
    if problems:
        raise RuntimeError("; ".join(problems))
    (out / MANIFEST).write_text(json.dumps(info, indent=2))
    return info


def install_command(python: str, kit: Path, site: Path) -> list[str]:
    """``pip install`` of every wheel in ``kit`` into the ``--target`` folder ``site`` with ``python`` (the image's
    own): no index, no dependencies resolved, no configuration read (``--isolated``: a machine's pip settings may name
    indexes), nothing compiled or cached."""
    wheels = sorted(str(w) for w in kit.glob("*.whl"))
    return [python, "-m", "pip", "--isolated", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
            "--no-cache-dir", "--upgrade", "--disable-pip-version-check", "--target", str(site), *wheels]


# What the check imports once the kit is in: the kernels' stack and every contender of the benchmark.
PROBE_MODULES = {"trl": "trl.experimental.async_distillation.async_distillation_trainer",
                 "liger-kernel": "liger_kernel.transformers", "cut-cross-entropy": "cut_cross_entropy",
                 "datasets": "datasets", "msgspec": "msgspec", "fastdistill": "fastdistill.loss",
                 "fastdistill_kernels": "fastdistill_kernels"}
PROBE = """
import importlib, importlib.metadata as md, json, sys
import torch, triton
out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
       "triton": triton.__version__, "gpu": torch.cuda.is_available() and torch.cuda.get_device_name(),
       "imports": {}}
for name, module in json.loads(sys.argv[1]).items():
    try:
        mod = importlib.import_module(module)
        try:
            version = md.version(name)
        except md.PackageNotFoundError:
            version = getattr(mod, "__version__", "source tree")
        out["imports"][name] = {"ok": True, "version": version, "file": getattr(mod, "__file__", None)}
    except Exception as e:
        out["imports"][name] = {"ok": False, "error": repr(e)[:500]}
print(json.dumps(out))
"""


def probe_command(python: str, modules: dict[str, str] | None = None) -> list[str]:
    """``python`` importing each of ``modules`` (distribution -> module; default :data:`PROBE_MODULES`); it prints one
    JSON line: the interpreter's torch / triton / CUDA, and per module ``ok`` with its version and file, or the
    error."""
    return [python, "-c", PROBE, json.dumps(PROBE_MODULES if modules is None else modules)]


def main(argv: list[str] | None = None) -> int:
    """Build the kit and print its contents and size; 1 when it cannot be built."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("build/device-kit"), help="the kit folder (created)")
    p.add_argument("--python-version", default=IMAGE_PYTHON,
                   help=f"the target interpreter's X.Y (default {IMAGE_PYTHON}, the GPU image's)")
    args = p.parse_args(argv)
    try:
        info = build(args.out, args.python_version)
    except RuntimeError as e:
        print(f"device kit: {e}", file=sys.stderr)
        return 1
    for w in info["wheels"]:
        print(f"{w['bytes'] / 2**20:7.2f} MiB  {w['file']}")
    print(f"{info['total_mib']:7.2f} MiB  in {args.out} (cp{args.python_version.replace('.', '')}; one call carries "
          f"{CALL_LIMIT_BYTES // 2**20} MiB)")
    for name, why in NOT_CARRIED.items():
        print(f"not carried: {name}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
