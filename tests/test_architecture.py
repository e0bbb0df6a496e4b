"""The shape of the code: layers import one way, the public API is the documented one, and the
tests' harness ships with the tests.

Layers, lowest first (a module may import its own layer and those below it):
``comm_hooks/kernels`` < ``comm_hooks/dist`` < ``comm_hooks/vote/encodings`` < ``comm_hooks/vote`` < ``comm_hooks`` (the DDP
adapters) < ``optim`` < ``integrations`` < ``benchmarks``.
"""

import ast
import importlib
import pathlib
import re
from pathlib import Path

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = [
    "comm_hooks/kernels",
    "comm_hooks/dist",
    "comm_hooks/vote/encodings",
    "comm_hooks/vote",
    "comm_hooks",
    "optim",
    "integrations",
    "benchmarks/workloads",
    "benchmarks/methods",
    "benchmarks/runtime",
    "benchmarks/cost",
    "benchmarks/reports",
    "benchmarks/runs",
    "benchmarks/netem",
    "benchmarks/commands",
    "benchmarks",
]
REFERENCE = "signmuon.comm_hooks.kernels.reference"


def _layer_of_path(path: pathlib.Path) -> int:
    """The deepest layer folder holding ``path`` (``comm_hooks/vote`` before ``comm_hooks``)."""
    relative = path.relative_to(ROOT).as_posix()
    return max(
        (i for i, layer in enumerate(LAYERS) if relative.startswith(layer + "/")), key=lambda i: LAYERS[i].count("/")
    )


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


LIBRARY = sorted(
    p for layer in ("comm_hooks", "optim", "integrations", "benchmarks") for p in (ROOT / layer).rglob("*.py")
)


def test_the_walk_sees_the_whole_package():
    assert len(LIBRARY) > 40
    assert _layer_of_module("signmuon.comm_hooks.vote.encodings.sign") == 2
    assert _layer_of_module("signmuon.comm_hooks.vote.transport") == 3
    assert _layer_of_module("signmuon.comm_hooks.allreduce") == 4
    assert _layer_of_module("signmuon.optim") == 5
    assert _layer_of_path(ROOT / "comm_hooks/vote/transport.py") == 3
    # A relative import one level up from a vote module lands in comm_hooks (the hooks layer).
    assert "signmuon.comm_hooks.dist" in {m for _, m in _imports(ROOT / "comm_hooks/vote/transport.py")}


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
    assert exported == _documented(page), (
        f"exported, not documented: {sorted(exported - _documented(page))}; "
        f"documented, not exported: {sorted(_documented(page) - exported)}"
    )


# The harness starts ranks with the benchmarks' launcher (one copy of spawn and rendezvous); that
# module imports only torch, so the library's tests still need nothing else of the benchmarks.
LAUNCHER = "signmuon.benchmarks.runtime.launch"


def test_only_the_benchmarks_own_tests_import_the_benchmarks():
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        if path.name.startswith("test_benchmarks"):  # test_benchmarks.py and its split-off files
            continue
        for line, module in _imports(path):
            launcher = path.name == "harness.py" and (module == LAUNCHER or module.startswith(LAUNCHER + "."))
            if module.startswith("signmuon.benchmarks") and not launcher:
                offenders.append(f"{path.name}:{line}: {module}")
    assert not offenders, offenders


def test_the_launcher_needs_nothing_else_of_the_package():
    path = ROOT / "benchmarks" / "runtime" / "launch.py"
    assert not [module for _, module in _imports(path) if module.startswith("signmuon.")]


# Modules that own a collective; everything else reaches them through ``comm_hooks.dist`` (or an
# exchange), where tensors are made on the group's device (``group_device``). The benchmarks'
# bandwidth command times raw collectives against ours, and their launcher synchronises ranks.
COLLECTIVE_OWNERS = {
    "comm_hooks/dist/groups.py",
    "comm_hooks/dist/tensors.py",
    "comm_hooks/vote/transport.py",
    "optim/checkpoint.py",
    "benchmarks/methods/collective.py",
    "benchmarks/runtime/launch.py",
}
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "gather_object",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "barrier",
    "monitored_barrier",
}


def _raw_collectives(path: pathlib.Path) -> list[str]:
    """``dist.X(...)`` / ``torch.distributed.X(...)`` calls of a collective X in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed"):
                found.append(f"line {node.lineno}: {owner}.{node.func.attr}")
    return found


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_collectives_are_issued_only_by_the_modules_that_own_them(path):
    relative = path.relative_to(ROOT).as_posix()
    raw = _raw_collectives(path)
    if relative in COLLECTIVE_OWNERS:
        assert raw, f"{relative} is listed as owning a collective but issues none: take it off the list"
    else:
        assert not raw, f"{relative} issues raw collectives (use signmuon.comm_hooks.dist): {raw}"


def test_no_device_argument_defaults_to_the_cpu():
    """A ``device="cpu"`` default puts a collective's tensors on the CPU under NCCL."""
    offenders = []
    for path in LIBRARY:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args + node.args.kwonlyargs
                defaults = (
                    [None] * (len(node.args.args) - len(node.args.defaults))
                    + node.args.defaults
                    + node.args.kw_defaults
                )
                for arg, default in zip(args, defaults):
                    if "device" in arg.arg and isinstance(default, ast.Constant) and default.value == "cpu":
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({arg.arg}='cpu')")
    assert not offenders, offenders


def _import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in LIBRARY}
    return {name: {m for _, m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_two_library_modules_import_each_other():
    """Every import counts, ``TYPE_CHECKING`` ones too: a cycle hidden from the interpreter is
    still two modules that cannot be read apart."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not _cycles(_import_graph()), _cycles(_import_graph())


BENCHMARKS = sorted((ROOT / "benchmarks").rglob("*.py"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_command_module_is_imported_as_a_library(path):
    """Commands share code through the groups below them; a command reaches another only as a
    command (``commands.load``), and nothing imports the entry point."""
    commands = ROOT / "benchmarks" / "commands"
    found = [
        f"line {line}: {module}"
        for line, module in _imports(path)
        if module.startswith("signmuon.benchmarks.__main__")
        or module.startswith("signmuon.benchmarks.commands.")
        and (commands / f"{module.split('.')[3]}.py").exists()  # a command module, not a name in the package
    ]
    assert not found, "\n".join(found)


def test_commands_are_run_through_the_dispatcher_in_docs_and_scripts():
    """A command module has no ``__main__`` block: ``python -m signmuon.benchmarks.commands.X`` would
    do nothing, so every example runs ``python -m signmuon.benchmarks X``."""
    texts = [p for p in ROOT.rglob("*") if p.suffix in (".py", ".md", ".sh") and ".venv" not in p.parts]
    texts = [p for p in texts if p != Path(__file__).resolve()]  # this test names the stale form
    stale = [
        str(p.relative_to(ROOT))
        for p in texts
        if p.is_file() and "results" not in p.parts and re.search(r"-m signmuon\.benchmarks\.\w", p.read_text())
    ]
    assert not stale, stale
