"""What a rank sent and received, and where its communication time went."""

from __future__ import annotations

import torch

__all__ = ["CommStats"]


class CommStats:
    """Calls, bytes sent and received, calls skipped for non-finite input, and where the time went.

    ``bytes_sent`` counts everything this rank sent; the node-aware vote also counts what it
    sent inside its node in ``bytes_sent_inside_node`` (the rest crossed between nodes:
    :attr:`bytes_sent_between_nodes`).

    Seconds on this rank's host thread: ``pack_seconds`` (encoding the signs and the zeros'
    lists), ``vote_seconds`` (the vote on the received shards, and its zeros' lists),
    ``unpack_seconds`` (decoding the result) and
    ``wait_seconds`` (blocked on the network: waiting for a collective, or in a blocking one).
    On a GPU kernels run asynchronously, so their time shows up where the host next waits for
    them (the headers' reads): the split is exact on CPU and indicative on GPU.

    Rounds with an outer step: ``round_seconds``, the combines of their pseudo-gradients;
    ``round_wait_seconds``, the part of it the training thread waited for. A round that lands
    where it is taken waits for all of it (its encoding, collectives and decoding). A streaming
    round (``sync_delay`` τ > 0) is counted from its collectives' issue (the encoding before it
    is the same work a whole round does): its collectives stay in flight during the next τ
    steps (their completion stamped by their futures), and everything from its landing on
    (the rest of the wait, the decoding) counts as waited; :attr:`round_hidden_share` is the
    share that training hid. ``round_steps_hidden`` counts the inner steps computed between a round's issue
    and its wait (τ a streamed round, 0 one that lands where it is taken).
    """

    _FIELDS = (
        "calls", "bytes_sent", "bytes_received", "skipped", "bytes_sent_inside_node", "bytes_received_inside_node",
        "pack_seconds", "vote_seconds", "unpack_seconds", "wait_seconds", "round_seconds", "round_wait_seconds",
        "round_steps_hidden",
    )
    __slots__ = (*(name for name in _FIELDS if name != "skipped"), "_skipped", "_skips_on_device")
    _SECONDS = ("pack_seconds", "vote_seconds", "unpack_seconds", "wait_seconds", "round_seconds", "round_wait_seconds")

    def __init__(self) -> None:
        self.calls = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self._skipped = 0
        self._skips_on_device = None  # a 0-d int64 count kept on the device, added to _skipped when read
        self.bytes_sent_inside_node = 0
        self.bytes_received_inside_node = 0
        self.pack_seconds = 0.0
        self.vote_seconds = 0.0
        self.unpack_seconds = 0.0
        self.wait_seconds = 0.0
        self.round_seconds = 0.0
        self.round_wait_seconds = 0.0
        self.round_steps_hidden = 0

    @property
    def skipped(self) -> int:
        """Calls skipped for non-finite input (a count kept on a device is read now, not when set)."""
        if self._skips_on_device is not None:
            self._skipped += int(self._skips_on_device)
            self._skips_on_device = None
        return self._skipped

    @skipped.setter
    def skipped(self, value: int) -> None:
        self._skipped, self._skips_on_device = value, None

    def skip_if(self, flag) -> None:
        """Count a skip where the 0-d bool ``flag`` is set, without reading it now (no host sync):
        added to one count on the flag's device, so a long run holds one tensor, not one per call."""
        if self._skips_on_device is None:
            self._skips_on_device = flag.to(torch.int64)
        else:
            self._skips_on_device += flag

    def add(self, sent: int, received: int, inside_node: bool = False) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        if inside_node:
            self.bytes_sent_inside_node += sent
            self.bytes_received_inside_node += received

    @property
    def round_hidden_share(self) -> float:
        """The share of ``round_seconds`` training did not wait for (NaN before any round)."""
        if self.round_seconds <= 0.0:
            return float("nan")
        return max(0.0, 1.0 - self.round_wait_seconds / self.round_seconds)

    @property
    def bytes_sent_between_nodes(self) -> int:
        return self.bytes_sent - self.bytes_sent_inside_node

    def state_dict(self) -> dict[str, int | float]:
        return {name: getattr(self, name) for name in self._FIELDS}

    def load_state_dict(self, state: dict[str, int | float]) -> None:
        for name in self._FIELDS:
            kind = float if name in self._SECONDS else int
            setattr(self, name, kind(state.get(name, 0)))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)}" for name in self._FIELDS)
        return f"CommStats({fields})"
