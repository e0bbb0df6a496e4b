"""Argument types every benchmark command shares: bad values end in one line and exit status 2
(argparse's own error path) before anything runs."""

from __future__ import annotations

import argparse
import os

import torch

from signmuon.comm_hooks.vote import ZERO_RULES

__all__ = [
    "add_vote_zeros",
    "command_parser",
    "network_label",
    "positive_int",
    "non_negative_float",
    "size",
    "check_device",
]

_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def positive_int(text: str) -> int:
    """An int >= 1 (world sizes, steps)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def non_negative_float(text: str) -> float:
    """A finite float >= 0 (durations)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0")
    return value


def size(text: str) -> int:
    """An entry count such as ``4096``, ``64K``, ``16M`` or ``1G``."""
    cleaned = text.strip().upper()
    scale = _SUFFIX.get(cleaned[-1:], 1)
    number = cleaned[:-1] if cleaned[-1:] in _SUFFIX else cleaned
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4096, 64K, 16M, 1G)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least one entry")
    return value


def check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """``parser.error`` unless ``device`` is ``cpu``, or ``cuda`` on a build and machine that have it."""
    kind = device.split(":")[0]
    if kind not in ("cpu", "cuda"):
        parser.error(f"--device {device!r}: use cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: this torch ({torch.__version__}) sees no CUDA device; use --device cpu")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written (examples keep their lines), every option's default shown."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        flag = action.nargs == 0  # --valley, --no-progress: their default is the absence of the flag
        if flag or "%(default)" in text or not action.option_strings or action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)".strip()


class _CommandParser(argparse.ArgumentParser):
    def add_argument(self, *args, **kwargs):
        # argparse prints no help line (so no default) for an option without help text.
        if "help" not in kwargs and kwargs.get("default") is not None and kwargs.get("nargs") != 0:
            kwargs["help"] = "(default: %(default)s)"
        return super().add_argument(*args, **kwargs)


def command_parser(command: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of ``signmuon-bench COMMAND``: that name in its usage line, the module's
    docstring as description without reStructuredText's double backticks, defaults shown.
    A ``--methods`` option comes from ``methods.registry.add_methods_option``."""
    description = (doc or "").replace("``", "")
    return _CommandParser(prog=f"signmuon-bench {command}", description=description, formatter_class=_HelpFormatter)


def network_label() -> str:
    """The emulated link a run is under (``netem`` sets it for the ranks it starts), or ``loopback``."""
    return os.environ.get("SIGNMUON_NETEM_RATE", "loopback")


def add_vote_zeros(parser: argparse.ArgumentParser) -> None:
    """The vote methods' ``--vote-zeros`` option (``VoteConfig.zeros``)."""
    parser.add_argument(
        "--vote-zeros",
        default="abstain",
        choices=ZERO_RULES,
        help="the vote's zero rule (VoteConfig.zeros): abstain, or a keyed coin (one bit per entry)",
    )
