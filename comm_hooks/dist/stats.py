"""What a rank sent and received, and where its communication time went."""

from __future__ import annotations

__all__ = ["CommStats"]


class CommStats:
    """Calls, bytes sent and received, calls skipped for non-finite input, and where the time went.

    ``bytes_sent`` counts everything this rank sent; the node-aware vote also counts what it
    sent inside its node in ``bytes_sent_inside_node`` (the rest crossed between nodes:
    :attr:`bytes_sent_between_nodes`).

    Seconds on this rank's host thread: ``pack_seconds`` (encoding the signs), ``vote_seconds``
    (the vote on the received shards), ``unpack_seconds`` (decoding the result) and
    ``wait_seconds`` (blocked on the network: waiting for a collective, or in a blocking one).
    On a GPU kernels run asynchronously, so their time shows up where the host next waits for
    them (the headers' reads): the split is exact on CPU and indicative on GPU.
    """

    __slots__ = (
        "calls", "bytes_sent", "bytes_received", "skipped", "bytes_sent_inside_node", "bytes_received_inside_node",
        "pack_seconds", "vote_seconds", "unpack_seconds", "wait_seconds",
    )  # fmt: skip
    _SECONDS = ("pack_seconds", "vote_seconds", "unpack_seconds", "wait_seconds")

    def __init__(self) -> None:
        self.calls = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.skipped = 0
        self.bytes_sent_inside_node = 0
        self.bytes_received_inside_node = 0
        self.pack_seconds = 0.0
        self.vote_seconds = 0.0
        self.unpack_seconds = 0.0
        self.wait_seconds = 0.0

    def add(self, sent: int, received: int, inside_node: bool = False) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        if inside_node:
            self.bytes_sent_inside_node += sent
            self.bytes_received_inside_node += received

    @property
    def bytes_sent_between_nodes(self) -> int:
        return self.bytes_sent - self.bytes_sent_inside_node

    def state_dict(self) -> dict[str, int | float]:
        return {name: getattr(self, name) for name in self.__slots__}

    def load_state_dict(self, state: dict[str, int | float]) -> None:
        for name in self.__slots__:
            kind = float if name in self._SECONDS else int
            setattr(self, name, kind(state.get(name, 0)))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)}" for name in self.__slots__)
        return f"CommStats({fields})"
