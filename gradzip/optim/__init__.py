"""Optimizers: LAMB, 1-bit Adam/LAMB and DeMo, and the builder behind ``gradzip train --optimizer``.

>>> from gradzip.optim import DeMo
>>> opt = DeMo(model.parameters(), lr=1e-3, comm=comm)  # doctest: +SKIP

- :class:`Lamb` (:mod:`gradzip.optim.lamb`): You et al. 2019, Algorithm 2.
- :class:`OneBitAdam` (:mod:`gradzip.optim.onebit`): 1-bit Adam and, with ``lamb=True``, 1-bit
  LAMB; the engine exchanges their compressed momentum (:meth:`gradzip.engine.Engine.bind_optimizer`).
- :class:`DeMo` (:mod:`gradzip.optim.demo`): Decoupled Momentum Optimization (Peng, Quesnelle &
  Kingma 2024), inside ``gradzip train`` or standalone with its own communicator.
- :func:`build_optimizer` (:mod:`gradzip.optim.build`): ``gradzip train``'s optimizers over
  BERT's two param groups, looked up in the registry (:mod:`gradzip.optim.registry`:
  :func:`register_optimizer` adds one).
"""

from gradzip.optim.build import build_optimizer, param_groups
from gradzip.optim.demo import DeMo
from gradzip.optim.lamb import Lamb
from gradzip.optim.onebit import OneBitAdam
from gradzip.optim.registry import register_optimizer, unregister_optimizer

__all__ = ["DeMo", "Lamb", "OneBitAdam", "build_optimizer", "param_groups", "register_optimizer",
           "unregister_optimizer"]
