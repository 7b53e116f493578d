"""The ``auto`` policy at run time, in one place: what it measures (:mod:`.measure`), when it
plans again (:mod:`.watch`: one rule for the engine and the DDP hook) and what it reports
(:mod:`.record`: ``policy.jsonl`` and the ``auto_*`` fields of ``summary.json``).

Below it: the spec's grammar (:mod:`gradzip.plan.auto`) and the per-bucket plan of the cost model
(:mod:`gradzip.cluster.auto`), which ``gradzip simulate`` shares. Above it: the engine's actuators,
:class:`gradzip.engine.auto.AutoEngine` and :class:`gradzip.engine.ddp_auto.AutoHookState`.
"""
