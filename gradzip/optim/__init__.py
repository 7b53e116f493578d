"""Optimizers for use outside ``gradzip train``, each with its own communication.

>>> from gradzip.optim import DeMo
>>> opt = DeMo(model.parameters(), lr=1e-3, comm=comm)  # doctest: +SKIP

- :class:`DeMo`: Decoupled Momentum Optimization (Peng, Quesnelle & Kingma 2024), see
  :mod:`gradzip.training.demo_optim`.
"""

from gradzip.training.demo_optim import DeMo

__all__ = ["DeMo"]
