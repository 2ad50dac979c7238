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

# Layers of qwen_runtime, lowest first: its folders, then the modules of the package root.  A module may import its
# own layer and the layers before it, never a later one; a new folder must be placed here.
RUNTIME_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("errors: the exceptions every layer raises", ("errors",)),
    ("quants: what the stored bytes mean, numpy only", ("quants",)),
    ("formats: architectures, config, GGUF keys, tensor names, finding and reading model files", ("formats",)),
    ("backend: numba, threads and kernel choice; weights, ops and their compiled twins, the KV cache", ("backend",)),
    ("models: the forward pass", ("models",)),
    ("text: tokenizer and chat template", ("text",)),
    ("generation: sampling, one row's step, the generation loop, evaluation", ("generation",)),
    ("tools: the package's face, its command lines and where their jobs run",
     ("__init__", "cli_support", "cli", "eval_cli", "executor")),
)
ROOT_LAYERS = {"errors", "tools"}  # the layers that are modules of the package root, not folders


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


def test_the_folders_are_the_layers() -> None:
    """Every folder of the runtime is a layer of its own, and the package root holds only the bottom and top layers'
    modules: a module is placed by where it lives."""
    folders = {p.parent.name for p in (ROOT / RUNTIME).glob("*/__init__.py")}
    layers = {layer.split(":")[0]: members for layer, members in RUNTIME_LAYERS}
    assert folders == {name for name in layers if name not in ROOT_LAYERS}
    assert all(layers[name] == (name,) for name in folders)
    root_modules = {p.stem for p in (ROOT / RUNTIME).glob("*.py")}
    assert root_modules == {m for name in ROOT_LAYERS for m in layers[name]}


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
    source = ("from ..backend.weights import gated_matmul\nfrom .base import Mixer\nfrom . import attention\n"
              "def f():\n    from ..text.chat import load_chat_format\n")
    names = imports_of(source, "qwen_runtime.models.transformer", is_package=False)
    assert {"qwen_runtime.backend.weights", "qwen_runtime.models.base", "qwen_runtime.models.attention",
            "qwen_runtime.text.chat"} <= names
    assert imports_of("from .text.chat import ChatFormat\n", RUNTIME, is_package=True) >= {"qwen_runtime.text.chat"}
    assert runtime_layer("qwen_runtime.text.chat") > runtime_layer("qwen_runtime.models.transformer")


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
