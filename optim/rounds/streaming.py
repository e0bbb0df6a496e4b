"""Streaming rounds (Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512; torchft's
``DiLoCo(model_fragments, sync_every, fragment_sync_delay, fragment_update_alpha)``): the
trained parameters are cut into F fragments, each with a consensus and an outer optimizer of
its own. With S = period / F, one fragment's round lands every S local steps, round-robin, so
each fragment's every ``period``; its pseudo-gradient is taken and combined ``sync_delay`` (τ)
steps before it lands, and each worker then keeps ``update_alpha`` (α) of its local weights::

    k = local steps since the warm-up (this one included)
    k + τ = j·S:   fragment (j - 1) mod F:  delta_i <- x_prev - x_i, combined over the workers
    k     = j·S:   x_prev <- outer step;  x_i <- lerp(x_i, x_prev, pull·(1 - α))
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from signmuon.comm_hooks import NodeLayout
from signmuon.comm_hooks.dist import CommStats

from .consensus import Consensus
from .pseudo_gradients import Combining

__all__ = [
    "Fragment",
    "InFlight",
    "streaming_group",
    "fragment_due",
    "fragment_members",
    "split_by_bytes",
    "check_fragments",
    "check_streaming",
]


def split_by_bytes(nbytes: Sequence[int], count: int) -> list[tuple[int, int]]:
    """``count`` runs ``(start, stop)`` of consecutive entries of ``nbytes`` (tensor sizes in
    module order), none empty, whose largest sum of bytes is as small as it can be; among the
    splits that reach it, each run takes as much as it can, first runs first."""
    if not 1 <= count <= len(nbytes):
        raise ValueError(f"fragments={count}: cannot cut {len(nbytes)} trained tensors into {count} non-empty runs")

    def runs(cap: int) -> list[tuple[int, int]] | None:
        found, start, total = [], 0, 0
        for i, size in enumerate(nbytes):
            left = len(nbytes) - i  # tensors from this one on; each run still to open needs one
            if i > start and (total + size > cap or left < count - len(found)):
                found.append((start, i))
                start, total = i, 0
            total += size
        found.append((start, len(nbytes)))
        return found if len(found) == count and max(sum(nbytes[a:b]) for a, b in found) <= cap else None

    lo, hi = max(nbytes), sum(nbytes)
    while lo < hi:  # the smallest cap a split into `count` runs reaches
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if runs(mid) is not None else (mid + 1, hi)
    return runs(lo)


def fragment_members(module: nn.Module, fragments: int | Sequence[Any]) -> list[list[nn.Parameter]]:
    """The trained parameters of each fragment, in ``module``'s order: ``fragments`` a count
    (consecutive runs balanced by bytes) or a list, each entry a module or a list of modules
    (their parameters that require grad). Every trained parameter in exactly one fragment."""
    trained = [p for p in module.parameters() if p.requires_grad]
    if isinstance(fragments, int) and not isinstance(fragments, bool):
        runs = split_by_bytes([p.numel() * p.element_size() for p in trained], fragments)
        return [trained[a:b] for a, b in runs]
    if isinstance(fragments, (str, bytes, nn.Module)) or not isinstance(fragments, Sequence) or not fragments:
        raise ValueError(
            f"fragments={fragments!r} must be a count or a non-empty list of fragments, each a module or list of modules"
        )
    owner: dict[int, int] = {}
    for f, entry in enumerate(fragments):
        modules = [entry] if isinstance(entry, nn.Module) else entry
        if not isinstance(modules, Sequence) or not all(isinstance(m, nn.Module) for m in modules):
            raise ValueError(f"fragments[{f}] must be a module or a list of modules, not {type(entry).__name__}")
        for p in (p for m in modules for p in m.parameters() if p.requires_grad):
            if owner.setdefault(id(p), f) != f:
                raise ValueError(f"a parameter is in fragments {owner[id(p)]} and {f}: each must be in one")
    index = {id(p): i for i, p in enumerate(trained)}
    if set(owner) - set(index):
        raise ValueError("fragments hold parameters that are not module=...'s trained parameters")
    missing = [i for i, p in enumerate(trained) if id(p) not in owner]
    if missing:
        raise ValueError(
            f"{len(missing)} trained parameter(s) of module= are in no fragment (the first: #{missing[0]})"
        )
    found: list[list[nn.Parameter]] = [[] for _ in fragments]
    for p in trained:
        found[owner[id(p)]].append(p)
    empty = [f for f, params in enumerate(found) if not params]
    if empty:
        raise ValueError(f"fragments {empty} hold no trained parameter")
    return found


def check_streaming(fragments: Any, delay: Any, alpha: Any, outer: Any) -> tuple[int, float]:
    """(sync_delay, update_alpha), checked; streaming needs an outer step."""
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise ValueError(f"sync_delay={delay!r} must be an int >= 0")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"update_alpha={alpha!r} must be in [0, 1]: the share of its local weights a worker keeps")
    if (not (isinstance(fragments, int) and fragments == 1) or delay or alpha) and outer is None:
        raise ValueError("fragments, sync_delay and update_alpha are streaming DiLoCo's: they need outer=")
    return delay, float(alpha)


def check_fragments(count: int, period: int, delay: int, push: float) -> None:
    """Refuse a schedule torchft's streaming DiLoCo refuses too (and push, which is the whole model's)."""
    if period % count:
        raise ValueError(f"period={period} must be a multiple of fragments={count}: one fragment lands every period/F")
    if delay >= period // count:
        raise ValueError(
            f"sync_delay={delay} must be < period/fragments={period // count}: a fragment's round lands "
            "before the next one is taken"
        )
    if count > 1 and push:
        raise ValueError("push moves a worker by its distance over the whole model; a fragment's round moves one part")


def fragment_due(k: int, period: int, count: int, delay: int) -> tuple[int | None, int | None]:
    """(the fragment whose round is taken, the fragment whose round lands) after ``k`` local
    steps since the warm-up (this one included); None where none."""
    every = period // count
    taken = (k + delay) // every - 1 if k > 0 and (k + delay) % every == 0 else None
    lands = k // every - 1 if k > 0 and k % every == 0 else None
    return (None if taken is None else taken % count), (None if lands is None else lands % count)


def streaming_group(group: dist.ProcessGroup, layout: NodeLayout | None, delay: int) -> dist.ProcessGroup | None:
    """The group a streaming round combines over (None: the rounds' own). Its collectives stay
    in flight during the next τ inner steps, so nothing else may use its group meanwhile:
    node-aware rounds use the rails, which nothing else uses during the inner steps; flat
    rounds over WORLD, which DDP also uses (its buffers' broadcast), get a group of their own
    (``new_group``: every rank builds the averager, so every rank calls it). A group given
    (FSDP2's ``mesh["node"]``) is the rounds' own."""
    if not delay or layout is not None or group is not dist.group.WORLD:
        return None
    return dist.new_group()


class InFlight:
    """A fragment's combine between its issue (the step its round is taken: the collectives
    started, asynchronously, by the training thread) and its landing (waited for). Nothing of
    it is read in between and no thread of ours runs: the collectives progress in the process
    group's own threads (on a GPU, on its own stream). Each collective's completion is stamped
    by its future, so the seconds counted are the collectives' own, not the steps between."""

    def __init__(self, start: Callable[[], list[Combining]]) -> None:
        self._combining = start()  # encoded and issued on the training thread, as a whole round's
        self._issued = self._done = time.perf_counter()
        for work in (w for c in self._combining for w in c.collectives()):
            work.get_future().add_done_callback(self._stamp)

    def _stamp(self, _future) -> None:
        self._done = max(self._done, time.perf_counter())

    def issues_at_wait(self) -> bool:
        """Whether waiting issues a collective (a two-phase reduction's second phase)."""
        return any(combining.issues_at_wait() for combining in self._combining)

    def wait(self) -> tuple[list[torch.Tensor], float, float]:
        """(the combined pseudo-gradients, seconds the combine took from its issue, seconds
        training waited for it): its collectives while training went on, then all of the
        landing's wait and decoding, which count as waited."""
        start = time.perf_counter()
        result = [combining.wait() for combining in self._combining]
        waited = time.perf_counter() - start
        return result, min(self._done, start) - self._issued + waited, waited


@dataclasses.dataclass
class Fragment:
    """One fragment: its trained parameters (module order), its consensus and outer optimizer,
    and its round between being taken and landing: ``in_flight`` while its combine runs,
    ``combined`` (the workers' combined pseudo-gradient of each group) once it is back, or
    ``skipped`` when the round was skipped as it was taken (NaN or Inf)."""

    params: list[nn.Parameter]
    consensus: Consensus
    combined: list[torch.Tensor] | None = None
    skipped: bool = False
    in_flight: InFlight | None = None

    def take(
        self, flats: list[torch.Tensor], stats: CommStats, group: dist.ProcessGroup | None, *, streamed: bool
    ) -> None:
        """Take this fragment's round from this worker's ``flats``: its pseudo-gradients,
        combined now or, ``streamed``, left in flight over ``group`` until it lands."""
        deltas = self.consensus.pseudo_gradients(flats)
        if streamed:
            self.in_flight = InFlight(functools.partial(self.consensus.start_combining, deltas, stats, group))
            return
        start = time.perf_counter()  # lands this very step: all of it waited for
        self.combined = self.consensus.combine(deltas, stats)
        seconds = time.perf_counter() - start
        stats.round_seconds += seconds
        stats.round_wait_seconds += seconds

    def settle(self, stats: CommStats) -> None:
        """Wait for the combine in flight (if any) and keep its result for the landing; its
        seconds and the seconds waited go to ``stats``."""
        if self.in_flight is not None:
            in_flight, self.in_flight = self.in_flight, None
            self.combined, seconds, waited = in_flight.wait()
            stats.round_seconds += seconds
            stats.round_wait_seconds += waited
