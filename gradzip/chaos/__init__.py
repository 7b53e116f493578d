"""``gradzip chaos``: replica groups of ``--sync ftdiloco`` on the emulated testbed, with faults
injected from a seed (kills and restarts, stalls, link partitions, late joins), and what they cost.

- :mod:`~gradzip.chaos.schedule`   the fault schedule, a pure function of the seed
- :mod:`~gradzip.chaos.harness`    the run: testbed, Lighthouse, group processes, injection, timeline
- :mod:`~gradzip.chaos.report`     recovery times, participation, goodput, digests, loss continuity
- :mod:`~gradzip.chaos.figures`    goodput against fault rate, participation, loss against time
- :mod:`~gradzip.chaos.lighthouse` a Lighthouse process that outlives every group
- :mod:`~gradzip.chaos.cli`        the command

It launches ``gradzip train`` processes and reads what they write; it imports nothing of training.
"""
