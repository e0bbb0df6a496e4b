"""Small values between the host and a device without stalling the device: host data staged
in pinned memory and copied asynchronously, device words read back through a pinned buffer."""

from __future__ import annotations

import threading

import torch

__all__ = ["from_host", "host_words"]


def from_host(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of the host ``values`` on ``device``, without stalling it.

    ``torch.tensor(values, device="cuda")`` copies from pageable memory, which synchronises the
    stream; here the values are staged in pinned memory and copied asynchronously (torch's
    pinned allocator keeps the staging buffer until the copy has run)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


_PINNED = threading.local()  # per thread (DDP's hooks run on the autograd thread): device -> pinned buffer


def host_words(words: torch.Tensor) -> list[int]:
    """The int64 ``words`` (1-D) as Python ints: one host synchronisation off the CPU.

    From a CUDA device they land in a pinned host buffer kept per device (a pageable copy
    stages through a bounce buffer first), copied on the current stream, which is then waited for.
    """
    if words.device.type != "cuda":
        return words.tolist()
    buffers = _PINNED.__dict__.setdefault("buffers", {})
    pinned = buffers.get(words.device)
    if pinned is None or pinned.numel() < words.numel():
        pinned = buffers[words.device] = torch.empty(max(words.numel(), 256), dtype=torch.int64, pin_memory=True)
    host = pinned[: words.numel()]
    host.copy_(words, non_blocking=True)
    torch.cuda.current_stream(words.device).synchronize()
    return host.tolist()
