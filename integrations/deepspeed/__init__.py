"""DeepSpeed integration: sign-vote optimizers from the DeepSpeed config, and a compressed backend.

DeepSpeed removed its 1-bit optimizers (0.19.7) and compressed communication backends
(0.19.8); this package is that missing piece::

    from signmuon.integrations import deepspeed as sm_ds
    engine, optimizer, _, scheduler = sm_ds.initialize(model=model, config="ds_config.json")

DeepSpeed itself is imported only when :func:`initialize` runs; without it that raises an
``ImportError`` naming the ``deepspeed`` extra. The compressed backend needs only
``torch.distributed`` (DeepSpeed's process groups are torch process groups).
"""

from .backend import SignCompressedBackend
from .engine import OPTIMIZER_TYPES, check_supported, initialize

__all__ = ["OPTIMIZER_TYPES", "SignCompressedBackend", "check_supported", "initialize"]
