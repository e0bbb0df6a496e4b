"""Encodings: how a rank's tensor becomes the words the transport moves, how a shard's senders
combine, and how the result decodes. Each implements the ``Encoding`` protocol of
:mod:`.wire` (``plan``, ``encode``, ``reduce``, ``decode``, ``plain_result``), whose header table
also names the flags each may use. Imports ``kernels`` and ``dist`` only.

* :mod:`.sign`: the majority vote's signs (one bit per entry), tie coins and the zero rule;
* :mod:`.zero_codes`: exact zeros as lists, runs or planes (the sign encoding's extras);
* :mod:`.scaled_sign`: 1-bit Adam's error-feedback scaled signs;
* :mod:`.scales`: float scales in 8 bits (the one-bit rounds' ``scale_bits=8``);
* :mod:`.faults`: Byzantine ranks, for tests of robustness.

``VOTE_ENCODINGS`` holds the encodings a vote can name (``VoteConfig.encoding``); each entry
builds the encoding of one call from the config, the kernel family and a :class:`~.sign.VoteCall`.
"""

from .faults import ByzantineFault
from .scaled_sign import ScaledSignEncoding, error_buffer_sizes, scaled_sign
from .scales import decode_log_scales, encode_log_scales
from .sign import EncodedRows, MomentumStep, SignEncoding, VoteCall, call_key
from .wire import Encoding, Plan

VOTE_ENCODINGS = {"sign": SignEncoding.for_vote}
"""The encodings ``VoteConfig.encoding`` may name, each a builder ``(config, kernels, call) -> Encoding``."""

__all__ = [
    "ByzantineFault",
    "EncodedRows",
    "Encoding",
    "MomentumStep",
    "Plan",
    "ScaledSignEncoding",
    "SignEncoding",
    "VOTE_ENCODINGS",
    "VoteCall",
    "call_key",
    "decode_log_scales",
    "encode_log_scales",
    "error_buffer_sizes",
    "scaled_sign",
]
