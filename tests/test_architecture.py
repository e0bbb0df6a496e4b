"""The shape of the code: layers import one way, the public API is the documented one, and the
tests' harness ships with the tests.

Layers, lowest first (a module may import its own layer and those below it):
``comm_hooks/kernels`` < ``comm_hooks/dist`` < ``comm_hooks/vote`` < ``comm_hooks`` (the DDP
adapters) < ``optim`` < ``integrations`` < ``benchmarks``.
"""

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = ["comm_hooks/kernels", "comm_hooks/dist", "comm_hooks/vote", "comm_hooks", "optim", "integrations", "benchmarks"]
REFERENCE = "signmuon.comm_hooks.kernels.reference"


def _layer_of_path(path: pathlib.Path) -> int:
    """The deepest layer folder holding ``path`` (``comm_hooks/vote`` before ``comm_hooks``)."""
    relative = path.relative_to(ROOT).as_posix()
    return max((i for i, layer in enumerate(LAYERS) if relative.startswith(layer + "/")), key=lambda i: LAYERS[i].count("/"))


def _layer_of_module(name: str) -> int | None:
    """The layer of ``signmuon.<folder>...`` (None for anything outside the package)."""
    if not name.startswith("signmuon."):
        return None
    parts = name.split(".")[1:]
    matching = [i for i, layer in enumerate(LAYERS) if parts[: len(layer.split("/"))] == layer.split("/")]
    return max(matching, key=lambda i: LAYERS[i].count("/")) if matching else None


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["signmuon", *parts])


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, relative ones resolved; for
    ``from X import a`` also ``X.a`` (a submodule, where ``a`` is one)."""
    tree = ast.parse(path.read_text())
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


LIBRARY = sorted(p for layer in ("comm_hooks", "optim", "integrations", "benchmarks") for p in (ROOT / layer).rglob("*.py"))


def test_the_walk_sees_the_whole_package():
    assert len(LIBRARY) > 40
    assert _layer_of_module("signmuon.comm_hooks.vote.exchange") == 2
    assert _layer_of_module("signmuon.comm_hooks.allreduce") == 3
    assert _layer_of_module("signmuon.optim") == 4
    assert _layer_of_path(ROOT / "comm_hooks/vote/exchange.py") == 2
    # A relative import one level up from a vote module lands in comm_hooks (the hooks layer).
    assert ("signmuon.comm_hooks.dist" in {m for _, m in _imports(ROOT / "comm_hooks/vote/exchange.py")})


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_imports_run_from_higher_layers_to_lower_ones(path):
    mine = _layer_of_path(path)
    upward = []
    for line, module in _imports(path):
        layer = _layer_of_module(module)
        if layer is not None and layer > mine:
            upward.append(f"line {line}: {module} ({LAYERS[layer]}) from {LAYERS[mine]}")
        if module.startswith("tests"):
            upward.append(f"line {line}: {module}: library code imports the tests")
        if module.startswith(REFERENCE) and path.parent.name != "kernels":
            upward.append(f"line {line}: {module}: library code calls a test reference")
    assert not upward, "\n".join(upward)


def _documented(page: str) -> set[str]:
    text = (ROOT / "docs" / "api" / page).read_text()
    return set(re.findall(r"^::: signmuon\.[a-z_.]+\.(\w+)$", text, flags=re.M))


@pytest.mark.parametrize("package, page, most", [("comm_hooks", "comm_hooks.md", 30), ("optim", "optim.md", None)])
def test_every_exported_name_is_in_the_api_reference(package, page, most):
    exported = set(importlib.import_module(f"signmuon.{package}").__all__)
    if most is not None:
        assert len(exported) <= most
    assert exported == _documented(page), f"exported, not documented: {sorted(exported - _documented(page))}; " \
        f"documented, not exported: {sorted(_documented(page) - exported)}"


def test_only_the_benchmarks_own_tests_import_the_benchmarks():
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        if path.name.startswith("test_benchmarks"):  # test_benchmarks.py and its split-off files
            continue
        for line, module in _imports(path):
            if module.startswith("signmuon.benchmarks"):
                offenders.append(f"{path.name}:{line}: {module}")
    assert not offenders, offenders
