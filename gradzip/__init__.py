"""gradzip: communication-efficient distributed training.

Sub-packages (one import package so that a single ``pip install`` gives every part and the
parts share one registry, one units parser and one cost model), bottom to top:

- :mod:`gradzip.compress`    compressors, error feedback, the registry of specs
- :mod:`gradzip.comm`        the Communicator contract and its backends (sim, torch, mpi)
- :mod:`gradzip.plan`        the bucket plan and the ``--sync`` spec (what the engine runs)
- :mod:`gradzip.cluster`     the one step-time model, ``gradzip simulate``
- :mod:`gradzip.engine`      attaches compression + communication to any ``nn.Module``: the one
  synchronisation protocol, the per-step engine, DiLoCo
- :mod:`gradzip.optim`       LAMB, 1-bit Adam/LAMB, DeMo
- :mod:`gradzip.models`      BERT for masked-LM pretraining
- :mod:`gradzip.data`        corpus, tokenizer and example pipeline
- :mod:`gradzip.netem`       the network testbed (namespaces + tc)
- :mod:`gradzip.training`    the training program, ``gradzip train``
- :mod:`gradzip.plots`       figures and results tables
- :mod:`gradzip.experiments` the experiment runner: specs, ``gradzip sweep``/``run``
- :mod:`gradzip.bench`       ``gradzip bench`` and the simulator's validation
- :mod:`gradzip.testing`     test batteries that run under torchrun/mpirun (the communicator self-test)
"""

import os as _os

__version__ = "0.1.0"

# Torch's OpenMP threads sleep while they wait instead of spinning (unless the user chose): a spinning
# thread takes a core from any other process, and its busy-waiting would count as work in sim's
# CPU-time clock. It takes effect when gradzip is imported before torch (the gradzip command is).
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def ddp_hook(spec: str, process_group=None, **kwargs):
    """Return ``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``.

    Example::

        state, hook = gradzip.ddp_hook("topk:ratio=0.01,ef=true")
        ddp_model.register_comm_hook(state, hook)

    ``spec`` may be ``"auto[:options]"``: the adaptive policy picks a compressor per DDP bucket
    (:mod:`gradzip.engine.ddp_auto`). Keyword arguments (``min_compress_numel``, ``timeout``, and
    ``log``: the auto policy's ``policy.jsonl``) go to :func:`gradzip.engine.hooks.ddp_hook`.
    """
    # Imported on use, so that `import gradzip` (the CLI reads __version__) does not load torch.
    from gradzip.engine.hooks import ddp_hook as _ddp_hook

    return _ddp_hook(spec, process_group=process_group, **kwargs)


def __getattr__(name: str):
    """``gradzip.DiLoCo`` and ``gradzip.LocalSGD`` (:mod:`gradzip.engine.diloco`),
    ``gradzip.fsdp_compress`` (:mod:`gradzip.engine.fsdp`), and the fault-tolerant outer syncs on
    torchft (the ``ft`` extra): ``gradzip.FTDiLoCo``, ``gradzip.FTSparseLoCo`` and
    ``gradzip.start_lighthouse``, imported on use."""
    if name in ("DiLoCo", "LocalSGD"):
        from gradzip.engine import diloco

        return getattr(diloco, name)
    if name == "fsdp_compress":
        from gradzip.engine.fsdp import fsdp_compress

        return fsdp_compress
    if name == "FTDiLoCo":
        from gradzip.engine.ftdiloco import FTDiLoCo

        return FTDiLoCo
    if name == "FTSparseLoCo":
        from gradzip.engine.ftsparseloco import FTSparseLoCo

        return FTSparseLoCo
    if name == "start_lighthouse":
        from gradzip.engine._ft import start_lighthouse

        return start_lighthouse
    raise AttributeError(f"module 'gradzip' has no attribute {name!r}")
