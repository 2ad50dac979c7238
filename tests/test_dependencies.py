"""Dependencies flow one way: the layers of the source tree, written down once and checked over every import.

Read from the source with :mod:`ast` (nothing is imported), so an import inside a function or under
``TYPE_CHECKING`` counts as much as one at the top of a file.  ``docs/code-structure.md`` explains the layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME, CONVERTER, SERVER = "qwen_runtime", "qwen_convert", "qwen_serve"
# First-party packages and those each may import: the runtime is the base of the others.
PACKAGE_IMPORTS = {RUNTIME: {RUNTIME}, CONVERTER: {RUNTIME, CONVERTER}, SERVER: {RUNTIME, SERVER}}

# Layers of qwen_runtime, lowest first: a module may import its own layer and the layers before it, never a
# later one.  Keys are module paths relative to the package ("formats" covers the subpackage).
RUNTIME_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("facts: errors, architectures, GGUF keys, config, tensor names, stored types, small kernels, the thread pool",
     ("errors", "archs", "rope", "gguf_keys", "config", "naming", "tensors", "quants", "ops", "jit_setup", "ops_jit",
      "pool", "pool_jit", "compile_events",
      "cache", "limits", "memory")),
    ("formats: finding and reading model files", ("formats", "hub")),
    ("weights: multiplying stored tensors", ("weights",)),
    ("models: the forward pass", ("models", "reference")),
    ("text: tokenizer and chat template", ("tokenizer", "sandbox", "chat")),
    ("generation: sampling, one row's step, the generation loop, evaluation",
     ("sampling", "stepper", "structured", "generate", "evaluate")),
    ("tools: the package's face, its command lines and where their jobs run",
     ("__init__", "cli_support", "cli", "eval_cli", "executor")),
)


def first_party_packages() -> set[str]:
    return {p.parent.name for p in ROOT.glob("*/__init__.py")}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Absolute names of everything ``path`` imports (``from .x import y`` yields both ``pkg.x`` and ``pkg.x.y``)."""
    return imports_of(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py")


def imports_of(source: str, module: str, is_package: bool) -> set[str]:
    package = module.split(".") if is_package else module.split(".")[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def source_files(directory: str) -> list[Path]:
    return sorted((ROOT / directory).rglob("*.py"))


def runtime_layer(module: str) -> int:
    """Index in RUNTIME_LAYERS of a ``qwen_runtime`` module (``qwen_runtime.formats.gguf_file`` -> formats)."""
    parts = module.split(".")[1:] or ["__init__"]
    for index, (_, members) in enumerate(RUNTIME_LAYERS):
        if parts[0] in members:
            return index
    raise LookupError(module)


def test_every_runtime_module_has_a_layer() -> None:
    unplaced = []
    for path in source_files(RUNTIME):
        try:
            runtime_layer(module_name(path))
        except LookupError:
            unplaced.append(str(path.relative_to(ROOT)))
    assert not unplaced, f"place these modules in RUNTIME_LAYERS of {Path(__file__).name}: {unplaced}"


def test_runtime_imports_no_later_layer() -> None:
    wrong = []
    for path in source_files(RUNTIME):
        try:
            own = runtime_layer(module_name(path))
        except LookupError:
            continue  # test_every_runtime_module_has_a_layer names it
        for name in imported_modules(path):
            if name.split(".")[0] != RUNTIME or name == RUNTIME:
                continue
            try:
                layer = runtime_layer(name)
            except LookupError:
                continue  # a name taken from a package (``from . import load``), not a module
            if layer > own:
                wrong.append(f"{path.relative_to(ROOT)} ({RUNTIME_LAYERS[own][0].split(':')[0]}) imports {name} "
                             f"({RUNTIME_LAYERS[layer][0].split(':')[0]})")
    assert not wrong, "\n".join(wrong)


def test_every_package_has_its_imports_listed() -> None:
    assert first_party_packages() == set(PACKAGE_IMPORTS)


@pytest.mark.parametrize("package", sorted(PACKAGE_IMPORTS))
def test_packages_import_only_packages_below_them(package: str) -> None:
    """qwen_runtime imports no other first-party package; the converter and the server import only the runtime."""
    allowed = PACKAGE_IMPORTS[package]
    forbidden = (first_party_packages() | {"tests", "scripts"}) - allowed
    wrong = [f"{path.relative_to(ROOT)} imports {name}" for path in source_files(package)
             for name in imported_modules(path) if name.split(".")[0] in forbidden]
    assert not wrong, "\n".join(wrong)


def test_runtime_never_imports_an_oracle() -> None:
    """torch and transformers are test-time oracles only."""
    wrong = [f"{path.relative_to(ROOT)} imports {name}" for path in source_files(RUNTIME)
             for name in imported_modules(path) if name.split(".")[0] in {"torch", "transformers"}]
    assert not wrong, "\n".join(wrong)


def test_scripts_do_not_import_tests() -> None:
    test_modules = {p.stem for p in (ROOT / "tests").glob("*.py")} | {"tests"}
    wrong = [f"{path.relative_to(ROOT)} imports {name}" for path in source_files("scripts")
             for name in imported_modules(path) if name.split(".")[0] in test_modules]
    assert not wrong, "\n".join(wrong)


def test_the_reader_resolves_relative_imports() -> None:
    """A backwards import written relatively, lazily or for type checking alone is still seen."""
    source = ("from ..weights import gated_matmul\nfrom .base import Mixer\nfrom . import attention\n"
              "def f():\n    from ..chat import load_chat_format\n")
    names = imports_of(source, "qwen_runtime.models.transformer", is_package=False)
    assert {"qwen_runtime.weights", "qwen_runtime.models.base", "qwen_runtime.models.attention",
            "qwen_runtime.chat"} <= names
    assert imports_of("from .chat import ChatFormat\n", RUNTIME, is_package=True) >= {"qwen_runtime.chat"}
    assert runtime_layer("qwen_runtime.chat") > runtime_layer("qwen_runtime.models.transformer")


def test_no_import_cycles() -> None:
    """Inside a layer too, no module reaches itself through imports (type-checking ones included)."""
    modules = {module_name(p): p for d in sorted(PACKAGE_IMPORTS) for p in source_files(d)}
    # A package's __init__ hands names on (and imports its submodules), so an import of it is not followed.
    graph = {m: {n for n in imported_modules(p) if n in modules and n != m and modules[n].name != "__init__.py"}
             for m, p in modules.items()}
    cycles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append(" -> ".join(path[path.index(module):] + [module]))
            return
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not cycles, "\n".join(cycles)
