"""A GPU world on a CPU-only build, for the tests: an accelerator whose tensors hold no data,
a process group whose collectives run without peers (torch's ``"fake"`` backend, registered as
that accelerator's backend), every collective's tensors checked against the group's device
(the accelerator), and every host read that library code issues counted.

On a GPU each host read (``.item()``, ``.tolist()``, ``bool()``, ``nonzero()``, a tensor built
from host data, ...) empties the stream, and a CPU tensor sent to an NCCL group is an error.
Neither shows on a CPU run with gloo; both show here.

The accelerator is the ``meta`` device, with the backend ``"meta:fake"``: its tensors carry
shapes, dtypes and devices through every op and hold no data, and library code treats it as it
treats a GPU (not the CPU; the device-agnostic ``torch`` kernel family). ``FakeTensorMode``'s
CUDA tensors would be closer in name, but on torch 2.13's CPU build Python indexing of them
(``x[2:5]``, ``x[mask]``) fails for want of a CUDA device guard. A read of a meta tensor has no
data behind it, so here it returns zeros (``False``, an empty ``nonzero``): the library then
takes its common path: finite values, no zeros to send, ranks that agree. So ``bool()``,
``item()`` and ``nonzero()`` give False, 0 and nothing, integers read as 0, and a bool tensor's
``tolist()`` gives True throughout (which parameters have a gradient on some rank: all). A
row built from host data and all-gathered reads back as that row on every rank (ranks alike).
"""

from __future__ import annotations

import ast
import collections
import contextlib
import functools
import os
import pathlib
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = tuple(str(ROOT / folder) + os.sep for folder in ("comm_hooks", "optim", "integrations", "benchmarks"))
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "cpu", "numpy")
FACTORIES = ("tensor", "as_tensor")
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "reduce",
    "send",
    "recv",
    "isend",
    "irecv",
)


@functools.lru_cache(maxsize=None)
def _real(name: str) -> str:
    return os.path.realpath(name)


def _library_site(depth: int = 2) -> str | None:
    """``file:line`` of the library frame that made this call (None when the caller is not library code)."""
    frame = sys._getframe(depth)
    name = _real(frame.f_code.co_filename)
    return f"{pathlib.Path(name).relative_to(ROOT)}:{frame.f_lineno}" if name.startswith(LIBRARY) else None


def _first_library_site() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        if _real(frame.f_code.co_filename).startswith(LIBRARY):
            return f"{pathlib.Path(_real(frame.f_code.co_filename)).relative_to(ROOT)}:{frame.f_lineno}"
        frame = frame.f_back
    return "outside the library"


def _zeros_like_list(t: torch.Tensor, flag: bool = False):
    value = flag if t.dtype == torch.bool else 0.0 if t.is_floating_point() else 0

    def build(shape):
        return [build(shape[1:]) for _ in range(shape[0])] if shape else value

    return build(tuple(t.shape))


@dataclass
class HostReads:
    """Host reads by library code, of tensors off the CPU (those a GPU would stall on)."""

    sites: collections.Counter = field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def reset(self) -> None:
        self.sites.clear()

    def __repr__(self) -> str:
        return f"HostReads(total={self.total}, sites={dict(self.sites)})"


@dataclass
class GpuWorld:
    device: torch.device
    reads: HostReads
    misplaced: list[str]
    """One line per collective that got a tensor off its group's device."""
    collectives: list[tuple[str, list[torch.Tensor]]] = field(default_factory=list)
    """Every collective issued: its name and tensors (shapes and dtypes; no data)."""


def _reading(name: str, original, world: GpuWorld):
    def read(self, *args, **kwargs):
        if self.device.type != "cpu":
            site = _library_site()
            if site is not None:
                world.reads.sites[f"{name} {site}"] += 1
        if self.device.type == "meta":
            if name == "item":
                return _zeros_like_list(self.reshape(()))
            if name == "tolist":
                known = _known(self)
                return known if known is not None else _zeros_like_list(self, flag=True)
            if name == "__bool__":
                return False
            if name == "__float__":
                return 0.0
            if name in ("__int__", "__index__"):
                return 0
            if name == "nonzero":
                if kwargs.get("as_tuple"):
                    return tuple(torch.zeros(0, dtype=torch.int64, device=self.device) for _ in range(self.dim()))
                return torch.zeros(0, max(self.dim(), 1), dtype=torch.int64, device=self.device)
        return original(self, *args, **kwargs)

    return read


def _known(t: torch.Tensor):
    """The host values behind a meta tensor, where known: its own, or its base's when it views
    all of it (a reshape)."""
    if getattr(t, "host_value", None) is not None:
        return t.host_value
    base = t._base
    if base is not None and getattr(base, "host_value", None) is not None and base.numel() == t.numel():
        return torch.tensor(base.host_value).reshape(t.shape).tolist()
    return None


def _moving(original):
    def to(self, *args, **kwargs):
        moved = original(self, *args, **kwargs)
        if self.device.type == "cpu" and moved.device.type == "meta":
            moved.host_value = self.tolist()  # what an all-gather hands back on every rank
        return moved

    return to


def _building(name: str, original, world: GpuWorld):
    def build(data, *args, **kwargs):
        made = original(data, *args, **kwargs)
        if made.device.type == "meta" and not isinstance(data, torch.Tensor):
            made.host_value = torch.as_tensor(data).tolist()  # what an all-gather hands back on every rank
            site = _library_site()
            if site is not None:
                world.reads.sites[f"torch.{name} {site}"] += 1  # a pageable copy to the device: a sync
        return made

    return build


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _checked(name: str, original, world: GpuWorld):
    def collective(*args, **kwargs):
        expected = world.device  # every group of this world is a "meta:fake" one
        world.collectives.append((name, [*_tensors(args), *_tensors(list(kwargs.values()))]))
        for t in (*_tensors(args), *_tensors(list(kwargs.values()))):
            if t.device != expected:
                world.misplaced.append(
                    f"{name} at {_first_library_site()}: a tensor on {t.device}, the group's device is {expected}"
                )
        if name == "all_gather" and _known(args[1]) is not None:
            outputs = args[0]
            base = outputs[0]._base
            if base is not None and all(o._base is base for o in outputs):
                base.host_value = [_known(args[1])] * len(outputs)
        return original(*args, **kwargs)

    return collective


def _is_cpu_test(node: ast.AST) -> str | None:
    """``"=="`` / ``"!="`` where ``node`` tests ``<x>.device.type`` against ``"cpu"`` (alone or in an ``and``)."""
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
        return next((op for op in map(_is_cpu_test, node.values) if op == "=="), None)
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.comparators[0], ast.Constant):
        left = ast.unparse(node.left)
        if left.endswith(".device.type") and node.comparators[0].value == "cpu":
            return "==" if isinstance(node.ops[0], ast.Eq) else "!=" if isinstance(node.ops[0], ast.NotEq) else None
    return None


def _lines(statements: list[ast.stmt]) -> set[int]:
    return {line for st in statements for line in range(st.lineno, st.end_lineno + 1)}


@functools.lru_cache(maxsize=None)
def cpu_only_lines(path: str) -> frozenset[int]:
    """Lines of ``path`` that only CPU tensors reach: under ``if x.device.type == "cpu":``, in the
    ``else`` of ``!= "cpu"``, and after ``if x.device.type != "cpu": return ...`` in its block."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(pathlib.Path(path).read_text())):
        for block in (getattr(node, "body", None), getattr(node, "orelse", None)):
            if not isinstance(block, list):
                continue
            for i, st in enumerate(block):
                if not isinstance(st, ast.If):
                    continue
                op = _is_cpu_test(st.test)
                if op == "==":
                    lines |= _lines(st.body)
                elif op == "!=":
                    lines |= _lines(st.orelse)
                    if st.body and isinstance(st.body[-1], ast.Return):
                        lines |= _lines(block[i + 1 :])
    return frozenset(lines)


@contextlib.contextmanager
def counting_host_reads():
    """Count host reads by library code in a real (CPU, gloo) run, leaving out those in branches
    only CPU tensors take (:func:`cpu_only_lines`): what the same run would read on a GPU."""
    reads = HostReads()

    def on_path(site: str | None) -> bool:
        if site is None:
            return False
        path, line = site.rsplit(":", 1)
        return int(line) not in cpu_only_lines(str(ROOT / path))

    def reading(name, original):
        def read(self, *args, **kwargs):
            site = _library_site()
            if on_path(site):
                reads.sites[f"{name} {site}"] += 1
            return original(self, *args, **kwargs)

        return read

    def building(name, original):
        def build(data, *args, **kwargs):
            site = _library_site()
            if not isinstance(data, torch.Tensor) and kwargs.get("device") is not None and on_path(site):
                reads.sites[f"torch.{name} {site}"] += 1
            return original(data, *args, **kwargs)

        return build

    patches = [(torch.Tensor, name, getattr(torch.Tensor, name)) for name in READS]
    patches += [(torch, name, getattr(torch, name)) for name in FACTORIES]
    for owner, name, original in patches:
        setattr(owner, name, (reading if owner is torch.Tensor else building)(name, original))
    try:
        yield reads
    finally:
        for owner, name, original in patches:
            setattr(owner, name, original)


@contextlib.contextmanager
def gpu_world(world_size: int = 4, rank: int = 0):
    """This process as ``rank`` of ``world_size`` CUDA ranks, until the block ends (see the module
    docstring). Build models and tensors inside the block, on ``world.device``."""
    if dist.is_initialized():
        raise RuntimeError("gpu_world() needs a process without a process group")
    world = GpuWorld(torch.device("meta"), HostReads(), [])
    patches: list[tuple[object, str, object]] = []

    def patch(owner, name, value):
        patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    for name in READS:
        patch(torch.Tensor, name, _reading(name, getattr(torch.Tensor, name), world))
    patch(torch.Tensor, "to", _moving(torch.Tensor.to))
    for name in FACTORIES:
        patch(torch, name, _building(name, getattr(torch, name), world))
    for name in COLLECTIVES:
        patch(dist, name, _checked(name, getattr(dist, name), world))
    dist.init_process_group("meta:fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield world
    finally:
        dist.destroy_process_group()
        for owner, name, value in reversed(patches):
            setattr(owner, name, value)


def on_device(build, device: torch.device) -> torch.nn.Module:
    """``build()``'s module, built on ``device``."""
    with device:
        return build()
