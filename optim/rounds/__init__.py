"""Local-step training: workers step on their own and meet in rounds.

* :mod:`.engine`: :class:`LocalStepAverager`, the schedule of rounds and what makes one safe;
* :mod:`.settings`: the averager's arguments and the settings every rank must share;
* :mod:`.members`: which tensors take part in a round, in which order, under which names;
* :mod:`.dppf`: DPPF's pull and push around the round's target;
* :mod:`.outer_step`: :class:`OuterStep`, the consensus stepped with the pseudo-gradients
  (``OuterStep.diloco()`` is DiLoCo), and :mod:`.pseudo_gradients`, how they are combined;
* :mod:`.consensus`: the consensus state of rounds with an outer step;
* :mod:`.agreement`: the checks every collective of the averager starts with;
* :mod:`.rails`: node-aware rounds, each local rank's slice over its rail;
* :mod:`.streaming`: streaming rounds (Streaming DiLoCo): fragments, each round taken τ steps
  before it lands;
* :mod:`.checkpoints`: the consensus to evaluate or save, and the averager's own checkpoint;
* :mod:`.post_local_sgd`: the wiring into DDP and ``PostLocalSGDOptimizer``;
* :mod:`.aliases`: tied weights and tensors that share memory;
* :mod:`.deprecated`: ``DPPFAverager``, the averager's name until 0.1.

Typical use (torch's ``PostLocalSGDOptimizer`` underneath; save ``opt.state_dict()`` to resume)::

    model = DDP(net)
    averager = LocalStepAverager(period=8, warmup_steps=100, pull=0.5, push=0.05, module=model.module)
    opt = local_sgd(model, torch.optim.SGD(model.parameters(), lr=0.05), averager)
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    weights = averager.consensus_state_dict(model.module)   # on every rank (a collective)
"""

from .deprecated import DPPFAverager
from .engine import DISTANCES, LocalStepAverager
from .outer_step import PSEUDO_GRADIENTS, OuterStep
from .post_local_sgd import local_sgd, register_local_sgd_hook

__all__ = [
    "DISTANCES",
    "DPPFAverager",
    "LocalStepAverager",
    "OuterStep",
    "PSEUDO_GRADIENTS",
    "local_sgd",
    "register_local_sgd_hook",
]
