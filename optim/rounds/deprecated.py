"""Names the rounds had before, kept for a release with a warning."""

from __future__ import annotations

import warnings
from typing import Any

from .engine import LocalStepAverager

__all__ = ["DPPFAverager"]


class DPPFAverager(LocalStepAverager):
    """The name :class:`LocalStepAverager` had until signmuon 0.1; it goes in 0.3."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        warnings.warn(
            "DPPFAverager is now LocalStepAverager (signmuon.optim.LocalStepAverager), the same class; "
            "the old name is removed in signmuon 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(*args, **kwargs)
