"""The training program: ``gradzip train``.

To change one training step, open :mod:`gradzip.training.loop` (the loop, top to bottom) and, for
the gradient exchange inside it, :mod:`gradzip.engine.engine` and :mod:`gradzip.engine.exchange`.

- :mod:`~gradzip.training.loop`        the loop: data, model, synchroniser, optimizer, resume, metrics
- :mod:`~gradzip.training.sync`        which synchroniser a configuration gets (:mod:`gradzip.engine.synchronizer`)
- :mod:`~gradzip.training.config`      :class:`TrainConfig`, TOML files, strict validation
- :mod:`~gradzip.training.cli`         the ``gradzip train`` flags
- :mod:`~gradzip.training.launch`      starting N local ranks, or ranks inside the network testbed
- :mod:`~gradzip.training.runtime`     where the process runs: communicator or sim world, device, data
- :mod:`~gradzip.training.checkpoint`  atomic checkpoints of every rank's state, resume, ``--out`` checks
- :mod:`~gradzip.training.schedule`    the warm-up/decay schedule (optimizers: :mod:`gradzip.optim`)
- :mod:`~gradzip.training.precision`   fp32/bf16/fp16 autocast and loss scaling
- :mod:`~gradzip.training.rng`         seeding and per-worker dropout streams
- :mod:`~gradzip.training.evaluate`    held-out loss
- :mod:`~gradzip.training.metrics`     the per-step record, ``metrics.jsonl`` and ``summary.json``
- :mod:`~gradzip.training.progress`    the progress bar
"""
