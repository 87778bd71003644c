"""Which kernel designs have run on a real GPU, keyed by everything that decides what runs, against a committed record.

A *design* is one loss's Triton backend (:data:`DESIGNS`). What a GPU run validates is the key of
``(design, triton version, launch pattern)``:

- the design's **code**: the whole source of every package module its code lives in — the modules of every
  definition reached from its entry point (host functions, classes, module-level values, ``@triton.jit`` code), so
  launch settings, tile configs, specialisation and dtype choices are inside it — found statically
  (:func:`design_modules`, an ``ast`` walk; no triton import) and hashed (sha256 per module);
- the **triton version**, major.minor (:func:`triton_minor`);
- the **launch pattern**: dtype or None of each float operand and whether it needs a gradient, as the design's
  autograd function receives them (:func:`launch_pattern`; the host code above it is hashed, so this decides the
  dtype / None specialisation of every kernel launch below it).

:func:`design_code_key` hashes the first two into one string (the key a per-device cache can use).
``validated.json`` beside this module holds, per design, the module hashes and triton version of the last passing
GPU check (``benchmarks/gpu_check.py`` computes them on the GPU machine from the tree it ran), with a verdict per
launch pattern the check's compiled tests ran (``"passed"``; a pattern seen in a failing test is ``"failed"``).
:func:`is_validated` is True when the code key matches and, given a pattern, that pattern passed.

    python -m fastdistill_kernels.validation                 # each design's state against the record
    python -m fastdistill_kernels.validation --sources DIR   # the module hashes of the kernel sources in DIR
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
RECORD_FILE = PACKAGE_DIR / "validated.json"
RECORD_SCHEMA = 2
PASSED, FAILED = "passed", "failed"

# (loss, backend) -> (module, function): the public entry point each design's host code starts from
DESIGNS: dict[tuple[str, str], tuple[str, str]] = {
    ("sparse", "triton"): ("ops", "fused_sparse_jsd"),
    ("sparse", "triton-chunked"): ("logits_chunk", "chunked_logits_sparse_jsd"),
    ("dense", "triton"): ("dense_fused", "fused_dense_teacher_jsd"),
    ("dense", "triton-chunked"): ("dense_chunk", "chunked_dense_teacher_jsd"),
}
# (loss, backend) -> (module, class): the autograd function every launch of the design goes through; its forward
# takes the float operands of PATTERN_OPERANDS[loss] first, in that order
AUTOGRAD_FUNCTIONS: dict[tuple[str, str], tuple[str, str]] = {
    ("sparse", "triton"): ("ops", "FusedSparseJSD"),
    ("sparse", "triton-chunked"): ("logits_chunk", "ChunkedLogitsSparseJSD"),
    ("dense", "triton"): ("dense_fused", "FusedDenseJSD"),
    ("dense", "triton-chunked"): ("dense_chunk", "DenseChunkedJSD"),
}
PATTERN_OPERANDS: dict[str, tuple[str, ...]] = {
    "sparse": ("hidden", "weight", "bias"),
    "dense": ("student_hidden", "student_weight", "student_bias", "teacher_hidden", "teacher_weight", "teacher_bias"),
}
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}

SourceReader = Callable[[str], str]  # module name (e.g. "ops") -> its source text


def source_hash(text: str) -> str:
    """sha256 (hex) of a source text, line endings normalised to ``\\n``."""
    return hashlib.sha256(text.replace("\r\n", "\n").encode()).hexdigest()


def read_package_module(module: str) -> str:
    """The source of ``fastdistill_kernels.<module>`` as installed beside this file."""
    return (PACKAGE_DIR / f"{module}.py").read_text(encoding="utf-8")


def folder_reader(folder: Path) -> SourceReader:
    """A :data:`SourceReader` of the modules in ``folder`` (e.g. a copy of the package, or a commit's sources)."""
    return lambda module: (Path(folder) / f"{module}.py").read_text(encoding="utf-8")


def _check_design(loss: str, backend: str) -> None:
    if (loss, backend) not in DESIGNS:
        raise ValueError(f"unknown kernel design {(loss, backend)!r}; designs: {sorted(DESIGNS)}")


# ------------------------------------------------------------------------------------------------ the code walk
def _is_jit(node: ast.AST) -> bool:
    """Whether a function definition carries ``@triton.jit`` / ``@jit`` (called with options or not)."""
    for deco in getattr(node, "decorator_list", ()):
        target = deco.func if isinstance(deco, ast.Call) else deco
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "jit":
            return True
    return False


def _package_relative(node: ast.ImportFrom) -> str | None:
    """The package module a ``from`` import names, relative to the package (``""`` for the package itself: ``from .
    import x``), or None for an import from elsewhere. ``from .x import`` and ``from fastdistill_kernels.x import``
    alike."""
    if node.level == 1:
        return node.module or ""
    if node.level == 0 and node.module and node.module.split(".")[0] == PACKAGE_DIR.name:
        return node.module.partition(".")[2]
    return None


class _Module:
    """One parsed module: its top-level definitions, package-relative imports and import-time statements."""

    def __init__(self, name: str, text: str):
        self.name = name
        self.defs: dict[str, ast.AST] = {}  # functions, classes and assigned names
        self.imports: dict[str, tuple[str, str | None]] = {}  # local name -> (module, name or None for a module)
        self.import_time: list[ast.AST] = []  # statements that run on import (calls, conditionals, ...)
        for node in ast.parse(text).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            self.defs[n.id] = node
            elif isinstance(node, ast.ImportFrom) and _package_relative(node) is not None:
                module = _package_relative(node)
                for alias in node.names:
                    local = alias.asname or alias.name
                    self.imports[local] = (module, alias.name) if module else (alias.name, None)
            elif not isinstance(node, (ast.Import, ast.ImportFrom)):
                self.import_time.append(node)


class _Package:
    """The package's modules, parsed on first use, and name resolution across their relative imports."""

    def __init__(self, read: SourceReader):
        self._read = read
        self._modules: dict[str, _Module] = {}

    def module(self, name: str) -> _Module:
        if name not in self._modules:
            self._modules[name] = _Module(name, self._read(name))
        return self._modules[name]

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, str | None] | None:
        """``(module, name)`` of the definition ``name`` refers to in ``module``, ``(module, None)`` for a package
        module, or None when it is not the package's (builtins, torch, triton, locals)."""
        m = self.module(module)
        if name in m.defs:
            return module, name
        if name in m.imports and depth < 20:
            target, attr = m.imports[name]
            if attr is None:
                return target, None
            try:
                self.module(target)
            except (FileNotFoundError, OSError):  # `from . import x` of a subpackage or a missing module
                return None
            return self.resolve(target, attr, depth + 1)
        return None

    def references(self, module: str, node: ast.AST) -> set[tuple[str, str | None]]:
        """The package definitions (and modules) the code of ``node`` refers to."""
        out: set[tuple[str, str | None]] = set()
        for n in ast.walk(node):
            if isinstance(n, ast.Name):
                hit = self.resolve(module, n.id)
                if hit:
                    out.add(hit)
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
                hit = self.resolve(module, n.value.id)
                if hit and hit[1] is None and n.attr in self.module(hit[0]).defs:
                    out.add((hit[0], n.attr))
        return out

    def node(self, ref: tuple[str, str]) -> ast.AST:
        return self.module(ref[0]).defs[ref[1]]


def design_modules(loss: str, backend: str, read: SourceReader = read_package_module) -> list[str]:
    """The package modules a design's code lives in, sorted: the entry point's module and the module of every
    definition reached from it (host functions, classes with their methods, module-level values, jit functions
    and what they call), and of everything the import-time statements of those modules refer to."""
    _check_design(loss, backend)
    pkg = _Package(read)
    entry = DESIGNS[(loss, backend)]
    seen: set[tuple[str, str]] = set()
    modules: set[str] = set()
    todo: list[tuple[str, str | None]] = [entry]
    while todo:
        ref = todo.pop()
        module, name = ref
        if module not in modules:
            modules.add(module)
            for stmt in pkg.module(module).import_time:
                todo.extend(pkg.references(module, stmt))
        if name is None or ref in seen:
            continue
        seen.add(ref)
        todo.extend(pkg.references(module, pkg.node(ref)))
    return sorted(modules)


def module_hashes(modules: Iterable[str], read: SourceReader = read_package_module) -> dict[str, str]:
    """``{module: sha256 of its source}``."""
    return {m: source_hash(read(m)) for m in sorted(modules)}


# ------------------------------------------------------------------------------------------------ the key
def installed_triton_version() -> str | None:
    """The installed triton's version (distribution metadata; triton is not imported), or None without one."""
    for dist in ("triton", "pytorch-triton"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def triton_minor(version: str | None) -> str:
    """``"3.6"`` for ``"3.6.0"`` / ``"3.6.0+git…"``; ``"none"`` for None."""
    if not version:
        return "none"
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


def code_key(loss: str, backend: str, modules: dict[str, str], triton: str) -> str:
    """sha256 of the design, its module hashes and the triton major.minor ``triton`` (canonical JSON)."""
    payload = {"schema": RECORD_SCHEMA, "design": [loss, backend], "triton": triton, "modules": modules}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def design_code_key(loss: str, backend: str, triton_version: str | None = None,
                    read: SourceReader = read_package_module) -> str:
    """The key of what a design runs, apart from the launch pattern: its modules' sources (:func:`design_modules`)
    and the triton major.minor (``triton_version``, default the installed one; ``"3.6.0"`` and ``"3.6"`` agree)."""
    triton = triton_minor(triton_version if triton_version is not None else installed_triton_version())
    return code_key(loss, backend, module_hashes(design_modules(loss, backend, read), read), triton)


def launch_pattern(loss: str, operands: Iterable, needs_grad: Iterable[bool] | None = None,
                   grad_enabled: bool = True) -> str:
    """The dtype / None pattern of a launch: ``"hidden=bf16:grad weight=bf16:grad bias=None"`` for the float
    operands of :data:`PATTERN_OPERANDS` ``[loss]`` (tensors or None, in that order; ``:grad`` where a gradient is
    needed: ``needs_grad`` when given, e.g. an autograd ``ctx.needs_input_grad``, else ``requires_grad`` while
    ``grad_enabled``). As the design's autograd function receives them: the entry points cast hidden and weight to
    their common dtype first."""
    names = PATTERN_OPERANDS[loss]
    operands = list(operands)
    if len(operands) != len(names):
        raise ValueError(f"a {loss} launch pattern takes {len(names)} operands ({', '.join(names)}), "
                         f"got {len(operands)}")
    flags = [grad_enabled and bool(getattr(x, "requires_grad", False)) for x in operands] if needs_grad is None \
        else list(needs_grad)[:len(names)]
    parts = []
    for name, x, grad in zip(names, operands, flags, strict=True):
        if x is None:
            parts.append(f"{name}=None")
            continue
        dtype = str(x.dtype).removeprefix("torch.")
        parts.append(f"{name}={DTYPE_NAMES.get(dtype, dtype)}{':grad' if grad else ''}")
    return " ".join(parts)


# ------------------------------------------------------------------------------------------------ the record
def load_record(path: Path | None = None) -> dict:
    """The validation record at ``path`` (default :data:`RECORD_FILE`): ``{"schema", "designs": {loss: {backend:
    {"validated_on", "triton", "modules", "code_key", "launch_patterns"}}}}``; an empty one when absent."""
    path = RECORD_FILE if path is None else path
    if not path.exists():
        return {"schema": RECORD_SCHEMA, "designs": {}}
    record = json.loads(path.read_text(encoding="utf-8"))
    if record.get("schema") != RECORD_SCHEMA:
        raise ValueError(f"{path}: validation record schema {record.get('schema')!r}, expected {RECORD_SCHEMA}")
    return record


@dataclass(frozen=True)
class DesignState:
    """A design against the record: ``validated`` (its code key matches and, when a pattern was asked about, that
    pattern passed) and why not: modules changed, added or removed; the triton versions; the pattern's verdict."""

    validated: bool
    changed_modules: tuple[str, ...] = ()
    triton_here: str = ""
    triton_ran: str = ""
    pattern: str | None = None
    pattern_verdict: str | None = None  # "passed", "failed" or None (never run)
    patterns_passed: int = 0

    def reason(self) -> str:
        """One line: why the design is not validated (empty when it is)."""
        why = []
        if not self.triton_ran:
            return "no GPU run on record"
        if self.changed_modules:
            why.append(f"changed since the GPU run: {', '.join(self.changed_modules)}")
        if self.triton_here != self.triton_ran:
            why.append(f"triton {self.triton_here} here, {self.triton_ran} on the GPU run")
        if self.pattern is not None and self.pattern_verdict != PASSED:
            why.append(f"launch pattern {self.pattern!r} " + ("failed on the GPU run" if self.pattern_verdict
                                                               else "never ran on a GPU"))
        if not self.patterns_passed:
            why.append("no launch pattern passed on the GPU run")
        return "; ".join(why)


def design_state(loss: str, backend: str, pattern: str | None = None, *, record: dict | None = None,
                 triton_version: str | None = None, read: SourceReader = read_package_module) -> DesignState:
    """Design ``(loss, backend)`` as installed (``read``, triton ``triton_version`` or the installed one) against
    ``record`` (default: :func:`load_record`)."""
    _check_design(loss, backend)
    record = load_record() if record is None else record
    entry = record.get("designs", {}).get(loss, {}).get(backend)
    here = triton_minor(triton_version if triton_version is not None else installed_triton_version())
    current = module_hashes(design_modules(loss, backend, read), read)
    if not entry:
        return DesignState(False, tuple(current), here, "", pattern)
    recorded = entry.get("modules", {})
    changed = tuple(sorted(m for m in set(recorded) | set(current) if recorded.get(m) != current.get(m)))
    patterns = entry.get("launch_patterns", {})
    passed = sum(v == PASSED for v in patterns.values())
    verdict = patterns.get(pattern) if pattern is not None else None
    ok = (not changed and here == entry.get("triton") and passed > 0
          and (pattern is None or verdict == PASSED))
    return DesignState(ok, changed, here, entry.get("triton", ""), pattern, verdict, passed)


@functools.cache
def validated_designs() -> frozenset[tuple[str, str]]:
    """The designs whose code key, as installed, is the record's (computed once per process; the record and the
    package do not change under a running process). A record or source that cannot be read validates nothing."""
    try:
        record = load_record()
        return frozenset(d for d in DESIGNS if design_state(*d, record=record).validated)
    except (OSError, ValueError, SyntaxError):
        return frozenset()


@functools.cache
def _record_patterns() -> dict[tuple[str, str], frozenset[str]]:
    try:
        designs = load_record().get("designs", {})
    except (OSError, ValueError):
        return {}
    return {(loss, backend): frozenset(p for p, v in entry.get("launch_patterns", {}).items() if v == PASSED)
            for loss, by in designs.items() for backend, entry in by.items()}


def is_validated(loss: str, backend: str, pattern: str | None = None) -> bool:
    """Whether design ``(loss, backend)`` as installed is what the record says a GPU ran: its code key matches and
    (given a :func:`launch_pattern`) that pattern passed there (without one: some pattern passed)."""
    _check_design(loss, backend)
    if (loss, backend) not in validated_designs():
        return False
    return pattern is None or pattern in _record_patterns().get((loss, backend), frozenset())


def run_keys(read: SourceReader = read_package_module, triton_version: str | None = None) -> dict:
    """What a GPU check records of the tree it ran: the triton version and, per design, its module hashes and code
    key (``{"triton", "designs": {loss: {backend: {"modules", "code_key"}}}}``)."""
    triton = triton_minor(triton_version if triton_version is not None else installed_triton_version())
    designs: dict[str, dict[str, dict]] = {}
    for loss, backend in DESIGNS:
        modules = module_hashes(design_modules(loss, backend, read), read)
        designs.setdefault(loss, {})[backend] = {"modules": modules,
                                                 "code_key": code_key(loss, backend, modules, triton)}
    return {"triton": triton, "designs": designs}


def new_record(run: dict, keys: dict, patterns: dict) -> dict:
    """The record of one GPU run: per design, ``keys`` (:func:`run_keys` of the tree that ran), the launch
    patterns' verdicts ``patterns[loss][backend]`` (``{pattern: "passed" | "failed"}``) and ``run`` (commit, date,
    machine, software, the compiled tests). A design without a passing pattern is left out."""
    designs: dict[str, dict[str, dict]] = {}
    for loss, by in keys["designs"].items():
        for backend, key in by.items():
            verdicts = dict(sorted(patterns.get(loss, {}).get(backend, {}).items()))
            if PASSED not in verdicts.values():
                continue
            designs.setdefault(loss, {})[backend] = {"validated_on": run, "triton": keys["triton"], **key,
                                                     "launch_patterns": verdicts}
    return {"schema": RECORD_SCHEMA, "designs": designs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", type=Path, help="print the module hashes and code keys of the kernel modules in "
                   "this folder")
    p.add_argument("--triton", help="the triton version to key with (default: the installed one)")
    args = p.parse_args(argv)
    if args.sources:
        print(json.dumps(run_keys(folder_reader(args.sources), args.triton), indent=2))
        return 0
    record = load_record()
    for loss, backend in DESIGNS:
        state = design_state(loss, backend, record=record, triton_version=args.triton)
        entry = record.get("designs", {}).get(loss, {}).get(backend, {})
        if state.validated:
            run = entry.get("validated_on", {})
            text = (f"validated (triton {state.triton_ran}, {state.patterns_passed} launch patterns; "
                    f"{run.get('commit', '?')} on {run.get('machine', '?')})")
        else:
            text = f"NOT validated: {state.reason()}"
        print(f"{loss:6} {backend:15} {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
