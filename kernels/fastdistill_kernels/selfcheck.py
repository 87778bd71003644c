"""First use on a GPU decides: every kernel design checked against a float64 reference, the passing ones timed.

When fastdistill's ``backend="auto"`` first meets a device, :func:`auto_designs` runs each design of the loss
(:data:`fastdistill_kernels.validation.DESIGNS`) on the edge cases of :mod:`fastdistill_kernels.selfcheck_cases`
(on a CPU under ``TRITON_INTERPRET=1``: its small rehearsal set), refuses every design whose loss or gradients leave
the tolerance the arithmetic allows (with a warning naming the design and its worst mismatch), then times the
designs that passed at the caller's shape class. Verdicts and timings are cached in one JSON file per key (device
name, compute capability, driver, torch, triton, kernel code) under :func:`cache_dir`; designs the committed record
validated on this compute capability skip the correctness part. In a distributed job rank 0 decides for all ranks.

    FASTDISTILL_SELFCHECK=0          auto uses the committed record only (no check, no timing)
    FASTDISTILL_SELFCHECK_DIR=DIR    where the verdicts are kept (default $XDG_CACHE_HOME/fastdistill/selfcheck)
    python -m fastdistill_kernels.selfcheck [--loss sparse dense] [--dtype bfloat16 float32] [--inject-fault DESIGN]
                                            [--time N,D,V,K] [--json PATH] [--write-cache]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton

from . import selfcheck_cases as cases
from . import validation

SCHEMA = 1
OFF_ENV = "FASTDISTILL_SELFCHECK"  # "0": no self-check
DIR_ENV = "FASTDISTILL_SELFCHECK_DIR"  # the cache folder
BACKENDS = ("triton-chunked", "triton")  # a loss's designs, in the order of their predicted speed
CHECK_DTYPES = ("bfloat16", "float32")  # the CLI checks both; auto checks the caller's (float16: the bf16 cases)
TIMING_REPEATS = 3  # timed calls per design at the caller's shape, after one warm-up call; the median counts


def design_name(loss: str, backend: str) -> str:
    return f"{loss}/{backend}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def verdict_name(loss: str, backend: str, dtype: str) -> str:
    """A verdict's name in the cache: the design and the operand dtype its cases ran in."""
    return f"{design_name(loss, backend)} {dtype}"


def enabled() -> bool:
    """Whether ``auto`` runs the self-check (``FASTDISTILL_SELFCHECK`` is not "0")."""
    return os.environ.get(OFF_ENV, "").strip() != "0"


def cache_dir() -> Path:
    """``FASTDISTILL_SELFCHECK_DIR``, else ``$XDG_CACHE_HOME/fastdistill/selfcheck``, else
    ``~/.cache/fastdistill/selfcheck``."""
    if os.environ.get(DIR_ENV, "").strip():
        return Path(os.environ[DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    return Path(base) / "fastdistill" / "selfcheck"


# ------------------------------------------------------------------------------------------------- the key


@functools.cache
def kernel_code_key() -> str:
    """sha256 over every design's code key (:func:`fastdistill_kernels.validation.design_code_key`: the whole source
    of each module its code lives in, and the triton major.minor)."""
    keys = {design_name(*d): validation.design_code_key(*d) for d in sorted(validation.DESIGNS)}
    text = json.dumps(keys, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _driver_version() -> str:
    """The CUDA driver's version (``cuDriverGetVersion``), or "unknown"."""
    try:
        lib = ctypes.CDLL("libcuda.so.1" if sys.platform != "win32" else "nvcuda.dll")
        out = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(out)) == 0:
            return f"{out.value // 1000}.{out.value % 1000 // 10}"
    except (OSError, AttributeError):
        pass
    return "unknown"


def device_key(device: torch.device) -> dict:
    """What the verdicts hold for: the device's name and compute capability, the driver, torch, triton, and the
    kernel code. A CPU (the interpreter) is keyed as such."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name, capability, driver = torch.cuda.get_device_name(device), f"{major}.{minor}", _driver_version()
    else:
        name, capability, driver = f"{platform.machine()} CPU, triton interpreter", "none", "none"
    return {"device": name, "capability": capability, "driver": driver, "torch": torch.__version__,
            "triton": triton.__version__, "kernels": kernel_code_key()}


def cache_file(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / f"{digest}.json"


def read_cache(key: dict) -> dict:
    """The cached verdicts and timings for ``key``, or an empty entry (absent, unreadable or another key's)."""
    path = cache_file(key)
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"schema": SCHEMA, "key": key, "verdicts": {}, "timings": {}}
    if entry.get("schema") != SCHEMA or entry.get("key") != key:
        return {"schema": SCHEMA, "key": key, "verdicts": {}, "timings": {}}
    return entry


def write_cache(entry: dict) -> None:
    """Merge ``entry`` into its file (another process may have added verdicts or timings) and replace the file
    atomically. A folder that cannot be written costs a warning: the check then runs again next process."""
    path = cache_file(entry["key"])
    old = read_cache(entry["key"])
    merged = {"schema": SCHEMA, "key": entry["key"], "verdicts": {**old["verdicts"], **entry["verdicts"]},
              "timings": {k: {**old["timings"].get(k, {}), **v} for k, v in {**old["timings"],
                                                                         **entry["timings"]}.items()}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".selfcheck-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(merged, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:
        warnings.warn(f"fastdistill_kernels self-check: cannot write {path} ({exc}); set {DIR_ENV} to a writable "
                      "folder, or the check runs again in the next process", RuntimeWarning, stacklevel=3)


# ------------------------------------------------------------------------------------------------- the check


@dataclass
class Verdict:
    """One design on one key: ``passed``; ``source`` "self-check" or "record" (the committed record validated the
    same code on this compute capability); ``worst`` the largest error / tolerance over the cases; ``mismatch`` what
    failed (the case, the output and the entry, or the exception); ``seconds`` the check's wall time."""

    passed: bool
    source: str
    worst: float = 0.0
    mismatch: str = ""
    seconds: float = 0.0


def record_covers(loss: str, backend: str, key: dict) -> bool:
    """Whether the committed record validated this design's code on a GPU of this compute capability."""
    if key["capability"] == "none" or not validation.is_validated(loss, backend):
        return False
    try:
        run = validation.load_record()["designs"][loss][backend]["validated_on"]
    except (KeyError, OSError, ValueError):
        return False
    found = re.search(r"compute capability (\d+\.\d+)", str(run.get("machine", "")))
    return bool(found) and found.group(1) == key["capability"]


def check_design(loss: str, backend: str, device: torch.device, dtype: str | None = None,
                 fault: cases.Fault | None = None,
                 on_case: Callable[[str, float, str], None] | None = None) -> Verdict:
    """Run one design on its loss's cases in ``dtype`` (None: every dtype; GPU cases on CUDA, the rehearsal set
    elsewhere); the first case out of tolerance, or an exception, refuses it. ``fault`` perturbs the design's
    outputs (the failing-path rehearsal); ``on_case(name, worst, detail)`` reports each case."""
    start = time.perf_counter()
    worst = 0.0
    for case in cases.cases_for(loss, dtype, on_gpu=device.type == "cuda"):
        try:
            x, ref = _case_data(case, str(device))
            out = cases.run_design(loss, backend, x)
            if fault is not None:
                out = fault(out)
            ratio, detail = cases.compare(out, ref)
        except Exception as exc:  # a compile or launch failure (or any other) refuses the design like a wrong result
            ratio, detail = math.inf, f"{type(exc).__name__}: {exc}"[:500]
        if on_case is not None:
            on_case(case.name, ratio, detail)
        worst = max(worst, ratio)
        if not ratio <= 1.0:
            return Verdict(False, "self-check", worst, f"case {case.name}: {detail}", time.perf_counter() - start)
    return Verdict(True, "self-check", worst, "", time.perf_counter() - start)


@functools.lru_cache(maxsize=8)
def _case_data(case: cases.Case, device: str) -> tuple[cases.Inputs, cases.Reference]:
    """A case's inputs and float64 reference, made once for both designs of its loss (cleared after a check)."""
    x = cases.make_inputs(case, torch.device(device))
    return x, cases.reference(x, interpreted=x.hidden.device.type != "cuda")


# ------------------------------------------------------------------------------------------------- timing


def shape_class(loss: str, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], k: int | None = None) -> str:
    """The caller's shape class: loss, dtype, rows rounded up to a power of two (≥ 256), the hidden sizes and
    vocabularies, and the candidate slots rounded up to a power of two; designs are timed once per class."""
    (h, w), *rest = pairs
    n = max(256, 1 << max(0, h.shape[0] - 1).bit_length())
    parts = [loss, dtype_name(torch.promote_types(h.dtype, w.dtype)), f"N{n}",
             f"D{w.shape[1]}", f"V{w.shape[0]}"]
    if rest:
        (_, wt), = rest
        parts += [f"Dt{wt.shape[1]}", f"Vt{wt.shape[0]}"]
    if k is not None:
        parts.append(f"K{1 << max(0, k - 1).bit_length()}")
    return "|".join(parts)


def timing_inputs(loss: str, pairs, k: int) -> cases.Inputs:
    """The caller's own tensors (detached, not copied; dW only if its weight requires a gradient) with synthetic
    candidates: ``k`` distinct ids per row."""
    (h, w), *rest = pairs
    n, v = h.shape[0], w.shape[0]
    k = max(1, min(k, v))
    train_weight = w.requires_grad
    if h.is_inference() or w.is_inference():  # made under torch.inference_mode: autograd needs normal tensors
        h, w = h.clone(), w.clone()
        rest = [(ht.clone(), wt.clone()) for ht, wt in rest]
    dev = h.device
    case = cases.Case("timing", loss, n=n, d=w.shape[1], v=v, dtype=dtype_name(h.dtype), k=k,
                      bias=False, train_weight=train_weight)
    x = cases.Inputs(case, h.detach(), w.detach(), None, torch.ones(n, device=dev))
    if loss == "sparse":
        x.ids = (torch.arange(n, device=dev)[:, None] * 7 + torch.arange(k, device=dev)[None]) % v
        x.lps = torch.full((n, k), -math.log(2 * k), device=dev)
        x.valid = torch.ones(n, k, dtype=torch.bool, device=dev)
    else:
        (ht, wt), = rest
        x.t_hidden, x.t_weight = ht.detach(), wt.detach()
    return x


def time_design(loss: str, backend: str, x: cases.Inputs) -> float:
    """Median seconds of a forward + backward of the design on ``x`` (after one warm-up call, which compiles)."""
    cuda = x.hidden.device.type == "cuda"

    def once() -> float:
        if cuda:
            torch.cuda.synchronize(x.hidden.device)
        t0 = time.perf_counter()
        cases.run_design(loss, backend, x)
        if cuda:
            torch.cuda.synchronize(x.hidden.device)
        return time.perf_counter() - t0

    once()
    return sorted(once() for _ in range(TIMING_REPEATS))[TIMING_REPEATS // 2]


# ------------------------------------------------------------------------------------------------- the decision


@dataclass
class Decision:
    """What the self-check says for one loss on one key: ``passed`` designs (backends), the timed ones fastest first
    at the caller's shape class, then the untimed ones in the predicted order; ``refused`` ``{backend: mismatch}``."""

    passed: list[str]
    refused: dict[str, str]


_DECIDED: dict[tuple, Decision] = {}  # per process: (device, cache folder, loss, dtype) -> the decision every call uses
_WARNED: set[str] = set()


def _warn_refused(name: str, verdict: dict) -> None:
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"fastdistill_kernels self-check: design {name} refused on this device, auto will not use "
                      f"it: {verdict['mismatch']}", RuntimeWarning, stacklevel=4)


def decide(loss: str, pairs, candidates: Sequence[str], k: int | None = None) -> Decision:
    """The verdicts for ``loss``'s designs in the caller's dtype on the device of ``pairs`` (cached, else checked
    now: only that dtype's cases, so a bf16 job compiles no fp32 variant) and the order of
    those that passed: the ``candidates`` among them (the designs the caller can run now, e.g. those that fit its
    memory) timed at the caller's shape class (cached, else timed now) when there are two to compare."""
    (h, w), *_ = pairs
    device, dtype = h.device, dtype_name(torch.promote_types(h.dtype, w.dtype))
    key = device_key(device)
    entry = read_cache(key)
    new = {"schema": SCHEMA, "key": key, "verdicts": {}, "timings": {}}
    for backend in BACKENDS:
        name = verdict_name(loss, backend, dtype)
        if name in entry["verdicts"]:
            continue
        if record_covers(loss, backend, key):
            verdict = Verdict(True, "record")
        else:
            verdict = check_design(loss, backend, device, dtype, fault=_FAULTS.get(design_name(loss, backend)))
        new["verdicts"][name] = asdict(verdict)
    _case_data.cache_clear()
    verdicts = {**entry["verdicts"], **new["verdicts"]}
    refused = {}
    for backend in BACKENDS:
        verdict = verdicts[verdict_name(loss, backend, dtype)]
        if not verdict["passed"]:
            refused[backend] = verdict["mismatch"]
            _warn_refused(verdict_name(loss, backend, dtype), verdict)
    passed = [b for b in BACKENDS if b not in refused]
    cls = shape_class(loss, pairs, k)
    times = dict(entry["timings"].get(cls, {}))
    untimed = [b for b in passed if b in candidates and b not in times]
    if len([b for b in passed if b in candidates]) > 1 and untimed:
        x = timing_inputs(loss, pairs, k or 8)
        for backend in untimed:
            try:
                times[backend] = time_design(loss, backend, x)
            except torch.cuda.OutOfMemoryError:  # does not fit beside the caller's tensors now: tried last
                times[backend] = math.inf
            except Exception as exc:  # it fails at the caller's shape (a compile or launch error): refused here
                refused[backend] = f"timing at {cls}: {type(exc).__name__}: {exc}"[:500]
                _warn_refused(verdict_name(loss, backend, dtype), {"mismatch": refused[backend]})
        passed = [b for b in passed if b not in refused]
        new["timings"][cls] = {b: t for b, t in times.items() if b not in refused}
    if new["verdicts"] or new["timings"]:
        write_cache(new)
    order = {b: i for i, b in enumerate(BACKENDS)}  # untimed ones after the timed, in the predicted order
    passed.sort(key=lambda b: (times.get(b, math.inf), order[b]))
    return Decision(passed, refused)


def _agreed(decision_fn: Callable[[], Decision]) -> Decision:
    """Rank 0's decision on every rank when torch.distributed is initialised with more than one rank (one
    broadcast; every rank makes this call at the same step, as its first ``auto`` loss of that kind), else this
    process's own."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return decision_fn()
    box = [decision_fn() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def auto_designs(loss: str, pairs, candidates: Sequence[str] = BACKENDS, k: int | None = None) -> list[str]:
    """The designs ``auto`` may run for ``loss`` on these tensors, fastest first: those that passed the self-check
    on this device (or that the record covers). Decided once per process per (device, loss, dtype), on rank 0 when
    distributed, timing the ``candidates`` (the designs that fit the caller's memory then) at the caller's shape;
    the caller still skips a design that does not fit at a later call."""
    (h, w), *_ = pairs
    memo = (str(h.device), str(cache_dir()), loss, torch.promote_types(h.dtype, w.dtype))
    if memo not in _DECIDED:
        with torch.inference_mode(False):
            _DECIDED[memo] = _agreed(lambda: decide(loss, pairs, candidates, k))
    return list(_DECIDED[memo].passed)


def forget() -> None:
    """Drop this process's decisions and warnings (tests, or after moving the cache)."""
    _DECIDED.clear()
    _WARNED.clear()


# A test hook: design name -> a fault applied to that design's outputs in the check (the failing-path rehearsal).
_FAULTS: dict[str, cases.Fault] = {}


# ------------------------------------------------------------------------------------------------- the CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loss", nargs="+", choices=("sparse", "dense"), default=["sparse", "dense"])
    p.add_argument("--dtype", nargs="+", choices=("bfloat16", "float32", "float16"), default=list(CHECK_DTYPES),
                   help="operand dtypes to check (default: bfloat16 float32)")
    p.add_argument("--inject-fault", action="append", default=[], metavar="LOSS/BACKEND",
                   help="rehearse the failing path: this design's dW loses its last vocabulary tile")
    p.add_argument("--time", default=None, metavar="N,D,V,K",
                   help="time the passing designs at this shape (default: 4096,4096,32768,8 on a GPU; off on a CPU)")
    p.add_argument("--json", type=Path, help="write the verdicts and times here")
    p.add_argument("--write-cache", action="store_true", help="also store the verdicts in the cache folder")
    args = p.parse_args(argv)
    known = {design_name(*d) for d in validation.DESIGNS}
    for name in args.inject_fault:
        if name not in known:
            p.error(f"--inject-fault {name!r}: designs are {sorted(known)}")
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif os.environ.get("TRITON_INTERPRET") == "1":
        device = torch.device("cpu")
    else:
        print("no CUDA device: run the rehearsal under TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    key = device_key(device)
    print(f"self-check on {key['device']} (capability {key['capability']}, driver {key['driver']}, torch "
          f"{key['torch']}, triton {key['triton']}, kernels {key['kernels'][:12]}); cases: "
          f"{'GPU' if device.type == 'cuda' else 'interpreter rehearsal'}")
    report = {"key": key, "designs": {}}
    entry = {"schema": SCHEMA, "key": key, "verdicts": {}, "timings": {}}
    start = time.perf_counter()
    for loss in args.loss:
        for backend in BACKENDS:
            name = design_name(loss, backend)
            fault = cases.drop_vocabulary_tail if name in args.inject_fault else None
            for dtype in args.dtype:
                vname = verdict_name(loss, backend, dtype)

                def on_case(case: str, ratio: float, detail: str, vname=vname) -> None:
                    state = "ok" if ratio <= 1.0 else "MISMATCH"
                    print(f"  {vname:31} {case:28} {state:8} worst {ratio:.3g}× tolerance"
                          + ("" if ratio <= 1.0 else f": {detail}"))

                verdict = check_design(loss, backend, device, dtype, fault=fault, on_case=on_case)
                entry["verdicts"][vname] = report["designs"][vname] = asdict(verdict)
                print(f"{vname:33} {'passed' if verdict.passed else 'REFUSED'} in {verdict.seconds:.2f} s"
                      + ("" if verdict.passed else f": {verdict.mismatch}"))
        _case_data.cache_clear()
    timing = args.time or ("4096,4096,32768,8" if device.type == "cuda" else None)
    if timing:
        try:
            n, d, v, k = (int(s) for s in timing.split(","))
        except ValueError:
            p.error(f"--time {timing!r}: expected N,D,V,K (four integers)")
        dtype = torch.bfloat16
        g = torch.Generator(device=device).manual_seed(0)
        h = torch.randn(n, d, device=device, generator=g).to(dtype)
        w = (torch.randn(v, d, device=device, generator=g) / d**0.5).to(dtype)
        for loss in args.loss:
            pairs = ((h, w),) if loss == "sparse" else ((h, w), (h, w))
            x = timing_inputs(loss, pairs, k)
            cls = shape_class(loss, pairs, k if loss == "sparse" else None)
            for backend in BACKENDS:
                vname = verdict_name(loss, backend, dtype_name(dtype))
                if not report["designs"].get(vname, {}).get("passed"):
                    continue
                seconds = time_design(loss, backend, x)
                entry["timings"].setdefault(cls, {})[backend] = seconds
                report["designs"][vname]["time_s"] = seconds
                print(f"{vname:33} {seconds * 1e3:9.2f} ms at {cls}")
    report["wall_s"] = time.perf_counter() - start
    print(f"self-check wall time {report['wall_s']:.2f} s")
    if args.write_cache and not args.inject_fault:
        write_cache(entry)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
