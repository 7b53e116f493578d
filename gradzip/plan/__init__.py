"""What the engine runs: the bucket plan (:mod:`gradzip.plan.buckets`: which parameters travel
together, in which order) and the synchronisation spec (:mod:`gradzip.plan.sync`: ``--sync step``,
``diloco:...``, ``localsgd:...``).

The engine (:mod:`gradzip.engine`) runs both; the cost model (:mod:`gradzip.cluster`) prices a
step from the very same plan, so a modelled step and a run bucket the model alike. The room sits
below both for that reason.
"""
