"""The package's shape: imports flow one way between the layers, no module imports another that imports it back
(lazy imports inside functions included), and no library module outgrows ~500 lines.

Read from the source with ``ast``, so an import hidden in a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"fastdistill": ROOT / "fastdistill", "fastdistill_kernels": ROOT / "kernels" / "fastdistill_kernels"}
MAX_LINES = 500
# Layers that must not import the training loop, and what else each must not import.
FORBIDDEN = {
    "fastdistill.loss": ("fastdistill.train", "fastdistill.rollout", "fastdistill.sync", "fastdistill.cache"),
    "fastdistill.logit_head": ("fastdistill.train", "fastdistill.rollout", "fastdistill.sync", "fastdistill.cache"),
    "fastdistill.errors": ("fastdistill",),
    "fastdistill.cross_tokenizer": ("fastdistill.rollout", "fastdistill.data", "fastdistill.loss", "fastdistill.train",
                                    "fastdistill.sync", "fastdistill.cache"),
    # data flows rollout → data: the data layer imports the rollout's types (samples, the prompt table), never back
    "fastdistill.rollout": ("fastdistill.train", "fastdistill.sync", "fastdistill.loss", "fastdistill.data"),
    "fastdistill.data": ("fastdistill.train", "fastdistill.sync"),
    "fastdistill.cache": ("fastdistill.train", "fastdistill.sync"),
    "fastdistill.sync": ("fastdistill.train", "fastdistill.rollout"),
    "fastdistill_kernels": ("fastdistill",),
}


def module_files() -> dict[str, Path]:
    modules = {}
    for top, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((top, *parts[:-1])) if parts[-1] == "__init__" else ".".join((top, *parts))
            modules[name] = path
    return modules


MODULES = module_files()


def imports_of(name: str, path: Path) -> set[str]:
    """The project modules ``name`` imports anywhere in its file (a ``from package import submodule`` names the
    submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def within(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_imports_flow_one_way(layer):
    wrong = sorted(f"{name} imports {target}" for name, targets in GRAPH.items() if within(name, layer)
                   for target in targets if any(within(target, banned) for banned in FORBIDDEN[layer]))
    assert not wrong, "\n".join(wrong)


def real_edges(name: str) -> set[str]:
    """``name``'s imports less a package's ``__init__`` importing its own submodules and a submodule importing its own
    package (re-exports: the package's own business, which the interpreter resolves)."""
    return {t for t in GRAPH[name] if not within(t, name) and not within(name, t)}


def cycles() -> list[list[str]]:
    """Every cycle of modules importing each other (up to 8 long), each once, starting at its smallest name."""
    found = set()
    for start in GRAPH:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for target in real_edges(node):
                if target == start:
                    first = path.index(min(path))
                    found.add(tuple(path[first:] + path[:first]))
                elif target not in path and len(path) < 8:
                    stack.append((target, path + [target]))
    return sorted(list(cycle) for cycle in found)


def test_the_graph_sees_lazy_relative_and_submodule_imports():
    """The checker itself: a lazy import inside a function (the dense loss's of a Triton kernel), relative imports
    (its of the reference), and ``from package import submodule`` are edges; a made-up two-module loop is found."""
    assert "fastdistill_kernels.dense_chunk" in GRAPH["fastdistill.loss.dense"]
    assert "fastdistill.loss.reference" in GRAPH["fastdistill.loss.dense"]
    assert "fastdistill.loss.outputs" in GRAPH["fastdistill.loss.reference"]
    assert "fastdistill.train.pipeline" in GRAPH["fastdistill.train.trainer"]
    saved = dict(GRAPH)
    try:
        GRAPH.update({"fastdistill.loss.api": GRAPH["fastdistill.loss.api"] | {"fastdistill.loss.dense"},
                      "fastdistill.loss.dense": GRAPH["fastdistill.loss.dense"] | {"fastdistill.loss.api"}})
        assert ["fastdistill.loss.api", "fastdistill.loss.dense"] in cycles()
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


def test_no_module_imports_one_that_imports_it_back():
    found = [" -> ".join(cycle + cycle[:1]) for cycle in cycles()]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_library_module_outgrows_its_size(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines (> {MAX_LINES}): split it"


def test_the_trainer_only_orchestrates():
    lines = len(MODULES["fastdistill.train.trainer"].read_text().splitlines())
    assert lines <= 460, f"trainer.py has {lines} lines: its parts belong in their own modules"


def outside_imports(path: Path) -> set[str]:
    """The top-level names of the packages outside the project that a file imports anywhere (lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.partition(".")[0])
    return found - {"fastdistill", "fastdistill_kernels"}


def test_the_cross_tokenizer_package_stays_below_its_users():
    """fastdistill.cross_tokenizer (alignment, vocabulary map, targets) is what the rollout, the packer and the trainer
    share: it imports none of their layers (FORBIDDEN above), no torch and no HTTP client, and they import it; no
    other module takes its name."""
    package = {name: path for name, path in MODULES.items() if within(name, "fastdistill.cross_tokenizer")}
    assert "fastdistill.cross_tokenizer.alignment" in package and "fastdistill.cross_tokenizer.targets" in package
    heavy = sorted(f"{name} imports {top}" for name, path in package.items() for top in outside_imports(path)
                   if top in ("torch", "aiohttp", "triton", "vllm"))
    assert not heavy, "\n".join(heavy)
    users = {layer for name, targets in GRAPH.items() for layer in ("fastdistill.rollout", "fastdistill.data",
                                                                     "fastdistill.train")
             if within(name, layer) and any(within(t, "fastdistill.cross_tokenizer") for t in targets)}
    assert users == {"fastdistill.rollout", "fastdistill.data", "fastdistill.train"}
    namesakes = sorted(str(p) for n, p in MODULES.items() if p.name == "cross_tokenizer.py" and n not in package)
    assert not namesakes, namesakes


def test_the_library_imports_nothing_the_wheel_leaves_out():
    """The installed packages run without the checkout: no module imports the test harness (fastdistill_testing, at
    the repository root, not in the wheel), the tests, the benchmarks or the examples, lazily or not."""
    checkout = {"fastdistill_testing", "tests", "conftest", "benchmarks", "examples"}
    wrong = sorted(f"{name} imports {top}" for name, path in MODULES.items() for top in outside_imports(path)
                   if top in checkout)
    assert not wrong, "\n".join(wrong)


# Modules that import inside a function, the most they may, and why: a start-up path to protect (the torch-free
# rollout child, the CLI's fast start) or an optional dependency that may be absent. Anything else imports at the top.
LAZY_IMPORTS = {
    "fastdistill.cache.sampled": (2, "the cache package imports no torch (`fastdistill score` of top-K candidates "
                                     "starts without it): only drawing sampled candidates needs torch and the loss"),
    "fastdistill.cache.score": (1, "transformers imports torch, which the cache package does not"),
    "fastdistill.cli": (14, "the CLI's fast start: each command imports what it runs"),
    "fastdistill.cross_tokenizer.vocabulary": (2, "transformers, only to load a tokenizer: the torch-free rollout "
                                                  "child imports the package"),
    "fastdistill.demo": (3, "matplotlib is optional (fastdistill[demo]): only the figure needs it"),
    "fastdistill.integrations.trl": (1, "TRL is optional: only a patched TRL trainer calls it"),
    "fastdistill.loss.api": (2, "the Triton kernels need triton, an optional dependency"),
    "fastdistill.loss.dense": (2, "the Triton kernels need triton (optional)"),
    "fastdistill.loss.routing": (3, "the kernels' chunk sizes and self-check: their modules import triton (optional)"),
    "fastdistill.rollout.sample": (2, "torch, for hidden states only: the rollout child imports this module"),
    "fastdistill.rollout.sequence": (1, "the hidden-state teacher's client imports torch: the rollout child"),
    "fastdistill.sync.channels": (3, "vLLM's NCCL helpers: vLLM is optional in the trainer's environment"),
    "fastdistill.sync.lora": (2, "peft is optional (fastdistill[lora])"),
    "fastdistill.sync.vllm_plugin": (1, "an older vLLM has no weight-transfer factory"),
    "fastdistill.train.lora": (1, "peft is optional (fastdistill[lora])"),
    "fastdistill.train.metrics": (1, "tensorboard is optional (report_to=['tensorboard'])"),
    "fastdistill.train.model": (3, "transformers' loaders, FSDP only when sharded"),
    "fastdistill.train.pipeline": (1, "transformers, for cross-tokenizer teachers' tokenizers only"),
    "fastdistill.train.teacher_head": (2, "huggingface_hub's cache lookup, absent without it"),
    "fastdistill_kernels.compat": (2, "triton is optional (CPU-only installs)"),
}


def function_imports(path: Path) -> int:
    """How many ``import`` statements ``path`` has inside a function or method (nested ones included)."""
    def count(node: ast.AST, inside: bool) -> int:
        return sum((inside and isinstance(child, (ast.Import, ast.ImportFrom)))
                   + count(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))
                   for child in ast.iter_child_nodes(node))
    return count(ast.parse(path.read_text()), False)


def test_imports_inside_functions_only_with_a_reason():
    """No module imports inside a function beyond its entry in LAZY_IMPORTS (none without an entry): a new one needs
    a start-up path or an optional dependency as its reason. Fewer is always welcome (lower the entry)."""
    found = {name: function_imports(path) for name, path in MODULES.items()}
    over = sorted(f"{name}: {n} imports inside functions, allowed {LAZY_IMPORTS.get(name, (0, ''))[0]}"
                  for name, n in found.items() if n > LAZY_IMPORTS.get(name, (0, ""))[0])
    assert not over, "\n".join(over)
    assert all(reason for _, reason in LAZY_IMPORTS.values())
    assert set(LAZY_IMPORTS) <= set(MODULES), sorted(set(LAZY_IMPORTS) - set(MODULES))
