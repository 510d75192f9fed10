"""The package's dependencies run one way (docs/architecture.md):

    cli -> serve -> trt -> {runtime, export} -> {model, convert} -> checkpoint -> ops -> {config, mxfp4}

A module may import its own package and any package on a lower layer; packages that share a
layer must not import each other (runtime/export, model/convert, config/mxfp4), and nothing
imports upward. ``utils`` may be imported by every layer and imports nothing of k3_trtllm
outside itself. Every import counts: absolute or relative, at module level or inside a
function (a lazy import is still an arrow). Read from the source with ``ast``, so the test
needs none of the imported libraries."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "k3_trtllm"

# top layer first; a package may import packages of later layers only
LAYERS = [("cli",), ("serve",), ("trt",), ("runtime", "export"), ("model", "convert"), ("checkpoint",), ("ops",),
          ("config", "mxfp4")]
LEVEL = {name: i for i, layer in enumerate(LAYERS) for name in layer}
UTILS = "utils"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path) -> list[tuple[int, str]]:
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py")


def imports_in(source: str, name: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, imported k3_trtllm module) for every import statement of module ``name``;
    ``from P import m`` names the submodule ``P.m`` where ``m`` is one."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.append((node.lineno, sub if is_module(sub) else module))
    return [hit for hit in dict.fromkeys(found) if hit[1].split(".")[0] == "k3_trtllm"]


def layer_of(module: str) -> str | None:
    """The k3_trtllm package ``module`` belongs to (``config``/``mxfp4`` are modules of their own)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = layer_of(module_name(path))
        for line, target in imports(path):
            there = layer_of(target)
            where = f"{path.relative_to(ROOT)}:{line} -> {target}"
            if here == there:
                continue
            if there is None:
                bad.append(f"{where} (the bare package: import the module that holds the name)")
            elif here == UTILS:
                bad.append(f"{where} (utils imports nothing of k3_trtllm outside utils)")
            elif there == UTILS:
                continue
            elif here not in LEVEL or there not in LEVEL:
                bad.append(f"{where} (package {here if here not in LEVEL else there} has no layer: add it to LAYERS)")
            elif LEVEL[there] < LEVEL[here]:
                bad.append(f"{where} (upward: {here} sits below {there})")
            elif LEVEL[there] == LEVEL[here]:
                bad.append(f"{where} (sideways: {here} and {there} share a layer)")
    return bad


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert packages | modules == set(LEVEL) | {UTILS}, "LAYERS must name every package of k3_trtllm"


def test_the_scan_sees_relative_absolute_and_lazy_imports():
    # the scan must find the arrows it judges, or an empty result would pass vacuously
    source = "\n".join([
        "import os",
        "from .. import ops",  # relative, names a package
        "from ..checkpoint.errors import CheckpointError, CheckpointWarning",  # one arrow
        "from . import caches",  # a sibling module of a plain module
        "import k3_trtllm.runtime.engine as engine",
        "from k3_trtllm.utils import strict_json",
        "def f():",
        "    from ..trt.engine_executor import EngineExecutor",  # lazy: still an arrow
        "    from k3_trtllm.config import K3Config",
    ])
    assert imports_in(source, "k3_trtllm.model.k3", is_package=False) == [
        (2, "k3_trtllm.ops"), (3, "k3_trtllm.checkpoint.errors"), (4, "k3_trtllm.model.caches"),
        (5, "k3_trtllm.runtime.engine"), (6, "k3_trtllm.utils.strict_json"), (8, "k3_trtllm.trt.engine_executor"),
        (9, "k3_trtllm.config")]
    # in a package's __init__, "." is the package itself
    in_init = imports_in("from .k3 import K3ForCausalLM", "k3_trtllm.model", is_package=True)
    assert in_init == [(1, "k3_trtllm.model.k3")]
    assert sum(len(imports(p)) for p in PACKAGE.rglob("*.py")) > 150


def test_dependencies_run_one_way():
    bad = violations()
    for line in bad:
        print(line)
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_two_classes_share_a_name():
    where = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(where) > 50
    shared = {name: places for name, places in where.items() if len(places) > 1}
    for name, places in shared.items():
        print(name, "->", ", ".join(places))
    assert not shared, f"class names defined more than once: {shared}"


def test_docs_architecture_states_this_order():
    """docs/architecture.md draws the arrows this test enforces, in this order."""
    arrow = " → ".join(", ".join(layer) for layer in LAYERS)
    assert arrow in (ROOT / "docs" / "architecture.md").read_text()
