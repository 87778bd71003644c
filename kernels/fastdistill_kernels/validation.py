"""Which kernel designs have run on a real GPU: the device code of each design, hashed, against a committed record.

A *design* is one loss's Triton backend: ``("sparse", "triton")`` (the fused kernels), ``("sparse",
"triton-chunked")`` (cuBLAS logits per chunk + two Triton passes), and the same two for the dense-teacher loss. What a
GPU run validates is the device code of the design: every ``@triton.jit`` function its host code launches, the jit
helpers those call, and the module-level values they read (``tl.constexpr`` constants). :func:`design_kernels` finds
them statically (an ``ast`` walk from the design's entry point through the package's host functions; no import of
triton needed) and :func:`design_hashes` hashes the source text of each one (sha256).

``validated.json`` beside this module records, per design, those hashes as of the last passing GPU check
(``benchmarks/gpu_check.py``; its read-off ``benchmarks/gpu_results.py`` prints the new record) with the run it comes
from. :func:`is_validated` is True when the design's kernels today hash to the record's: fastdistill's
``backend="auto"`` only picks such designs, so a kernel edited since the GPU run stays selectable by name but is not
the default until a GPU has run it.

    python -m fastdistill_kernels.validation                 # which designs match the record
    python -m fastdistill_kernels.validation --sources DIR   # the hashes of the module files in DIR (e.g. a commit's)
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
RECORD_FILE = PACKAGE_DIR / "validated.json"
RECORD_SCHEMA = 1

# (loss, backend) -> (module, function): the public entry point each design's host code starts from
DESIGNS: dict[tuple[str, str], tuple[str, str]] = {
    ("sparse", "triton"): ("ops", "fused_sparse_jsd"),
    ("sparse", "triton-chunked"): ("logits_chunk", "chunked_logits_sparse_jsd"),
    ("dense", "triton"): ("dense_fused", "fused_dense_teacher_jsd"),
    ("dense", "triton-chunked"): ("dense_chunk", "chunked_dense_teacher_jsd"),
}

SourceReader = Callable[[str], str]  # module name (e.g. "ops") -> its source text


def source_hash(text: str) -> str:
    """sha256 (hex) of a source text, line endings normalised to ``\\n``."""
    return hashlib.sha256(text.replace("\r\n", "\n").encode()).hexdigest()


def read_package_module(module: str) -> str:
    """The source of ``fastdistill_kernels.<module>`` as installed beside this file."""
    return (PACKAGE_DIR / f"{module}.py").read_text(encoding="utf-8")


def _is_jit(node: ast.AST) -> bool:
    """Whether a function definition carries ``@triton.jit`` / ``@jit`` (called with options or not)."""
    for deco in getattr(node, "decorator_list", ()):
        target = deco.func if isinstance(deco, ast.Call) else deco
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "jit":
            return True
    return False


class _Module:
    """One parsed module: its top-level definitions, assignments and package-relative imports."""

    def __init__(self, name: str, text: str):
        self.name = name
        self.lines = text.replace("\r\n", "\n").split("\n")
        self.defs: dict[str, ast.AST] = {}  # functions, classes and assigned names
        self.imports: dict[str, tuple[str, str | None]] = {}  # local name -> (module, name or None for a module)
        for node in ast.parse(text).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            self.defs[n.id] = node
            elif isinstance(node, ast.ImportFrom) and node.level == 1:
                for alias in node.names:
                    local = alias.asname or alias.name
                    self.imports[local] = (node.module, alias.name) if node.module else (alias.name, None)

    def source(self, node: ast.AST) -> str:
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
        return "\n".join(self.lines[first - 1 : node.end_lineno])


class _Package:
    """The package's modules, parsed on first use, and name resolution across their relative imports."""

    def __init__(self, read: SourceReader):
        self._read = read
        self._modules: dict[str, _Module] = {}

    def module(self, name: str) -> _Module:
        if name not in self._modules:
            self._modules[name] = _Module(name, self._read(name))
        return self._modules[name]

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, str] | tuple[str, None] | None:
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
            except (FileNotFoundError, OSError):
                return None
            return self.resolve(target, attr, depth + 1)
        return None

    def references(self, module: str, node: ast.AST) -> set[tuple[str, str]]:
        """The package definitions the code of ``node`` refers to (names, and ``module.attr`` of imported modules)."""
        out = set()
        for n in ast.walk(node):
            if isinstance(n, ast.Name):
                hit = self.resolve(module, n.id)
                if hit and hit[1] is not None:
                    out.add(hit)
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
                hit = self.resolve(module, n.value.id)
                if hit and hit[1] is None and n.attr in self.module(hit[0]).defs:
                    out.add((hit[0], n.attr))
        return out

    def node(self, ref: tuple[str, str]) -> ast.AST:
        return self.module(ref[0]).defs[ref[1]]


def design_kernels(loss: str, backend: str, read: SourceReader = read_package_module) -> dict[str, str]:
    """``{"module.name": source}`` of the device code of one design: the jit functions its host code (from the
    entry point in :data:`DESIGNS`, through every package function and class it reaches) refers to, the jit
    functions those call, and the module-level values any of them reads."""
    if (loss, backend) not in DESIGNS:
        raise ValueError(f"unknown kernel design {(loss, backend)!r}; designs: {sorted(DESIGNS)}")
    pkg = _Package(read)
    host_seen: set[tuple[str, str]] = set()
    device: set[tuple[str, str]] = set()
    host = [DESIGNS[(loss, backend)]]
    while host:  # host code: functions, classes (their methods), module-level values
        ref = host.pop()
        if ref in host_seen:
            continue
        host_seen.add(ref)
        for hit in pkg.references(ref[0], pkg.node(ref)):
            if _is_jit(pkg.node(hit)):
                device.add(hit)  # host code refers to a jit function: it launches it
            elif hit not in host_seen:
                host.append(hit)
    todo = list(device)
    while todo:  # device code: jit helpers and the module-level values jit code reads
        for hit in pkg.references(todo[0][0], pkg.node(todo.pop(0))):
            node = pkg.node(hit)
            if (_is_jit(node) or isinstance(node, (ast.Assign, ast.AnnAssign))) and hit not in device:
                device.add(hit)
                todo.append(hit)
    return {f"{m}.{n}": pkg.module(m).source(pkg.node((m, n))) for m, n in sorted(device)}


def design_hashes(read: SourceReader = read_package_module) -> dict[str, dict[str, dict[str, str]]]:
    """``{loss: {backend: {"module.name": sha256}}}`` of every design's device code (see :func:`design_kernels`)."""
    out: dict[str, dict[str, dict[str, str]]] = {}
    for loss, backend in DESIGNS:
        kernels = design_kernels(loss, backend, read)
        out.setdefault(loss, {})[backend] = {name: source_hash(text) for name, text in kernels.items()}
    return out


def load_record(path: Path | None = None) -> dict:
    """The validation record at ``path`` (default :data:`RECORD_FILE`): ``{"schema", "designs": {loss: {backend:
    {"validated_on", "kernels"}}}}``; an empty one when the file is absent."""
    path = RECORD_FILE if path is None else path
    if not path.exists():
        return {"schema": RECORD_SCHEMA, "designs": {}}
    record = json.loads(path.read_text(encoding="utf-8"))
    if record.get("schema") != RECORD_SCHEMA:
        raise ValueError(f"{path}: validation record schema {record.get('schema')!r}, expected {RECORD_SCHEMA}")
    return record


def changed_kernels(loss: str, backend: str, record: dict | None = None,
                    read: SourceReader = read_package_module) -> list[str]:
    """The kernels of a design whose source differs from the record's (added, removed or edited), sorted; every
    kernel when the record has no entry for the design."""
    record = load_record() if record is None else record
    recorded = record.get("designs", {}).get(loss, {}).get(backend, {}).get("kernels", {})
    current = {name: source_hash(text) for name, text in design_kernels(loss, backend, read).items()}
    if not recorded:
        return sorted(current)
    return sorted(name for name in set(recorded) | set(current) if recorded.get(name) != current.get(name))


@functools.cache
def validated_designs() -> frozenset[tuple[str, str]]:
    """The designs whose device code, as installed, is exactly what the record says a GPU ran (computed once per
    process). A record or source that cannot be read validates nothing."""
    try:
        record = load_record()
        return frozenset(d for d in DESIGNS if not changed_kernels(*d, record=record))
    except (OSError, ValueError, SyntaxError):
        return frozenset()


def is_validated(loss: str, backend: str) -> bool:
    """Whether design ``(loss, backend)`` may be picked by ``backend="auto"``: its kernels match the record."""
    if (loss, backend) not in DESIGNS:
        raise ValueError(f"unknown kernel design {(loss, backend)!r}; designs: {sorted(DESIGNS)}")
    return (loss, backend) in validated_designs()


def new_record(run: dict, hashes: dict | None = None) -> dict:
    """A record validating every design with ``hashes`` (default: today's, :func:`design_hashes`) on ``run``
    (commit, date, machine, software, the compiled tests that passed)."""
    hashes = design_hashes() if hashes is None else hashes
    return {"schema": RECORD_SCHEMA,
            "designs": {loss: {backend: {"validated_on": run, "kernels": kernels} for backend, kernels in by.items()}
                        for loss, by in hashes.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", type=Path, help="print the hashes of the kernel modules in this folder")
    args = p.parse_args(argv)
    if args.sources:
        print(json.dumps(design_hashes(lambda m: (args.sources / f"{m}.py").read_text(encoding="utf-8")), indent=2))
        return 0
    record = load_record()
    for loss, backend in DESIGNS:
        changed = changed_kernels(loss, backend, record)
        state = "validated" if not changed else f"NOT validated, changed since the GPU run: {', '.join(changed)}"
        print(f"{loss:6} {backend:15} {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
