"""Test harnesses that ship with the package, for checking a cluster or a backend in place.

``comm_selftest`` (``python -m gradzip.testing.comm_selftest``, under any launcher) runs the
battery of collectives of ``comm_battery`` on a real backend and checks it against the ``sim``
reference. Nothing else in ``gradzip`` imports this package.
"""
