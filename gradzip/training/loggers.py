"""Live curves: sinks that stream a run's ``metrics.jsonl`` records to TensorBoard, W&B or MLflow.

``metrics.jsonl`` stays the source of truth; a sink receives every record right after it is
written there (the same numbers: losses, accuracies, bytes, phase times, learning rate), and the
run's configuration once as hyper-parameters. ``gradzip train --log tensorboard,wandb,mlflow``
picks sinks; each needs its optional extra (``pip install 'gradzip[tensorboard]'``) and only rank
0 logs. Where each writes, by default inside the run directory so nothing leaves the machine:

- ``tensorboard``: ``<out>/tensorboard/`` event files (``tensorboard --logdir runs/`` shows every
  run or sweep cell below it, named by its directory). Hyper-parameters go to the HParams tab,
  with the eval metrics as its metric columns. A resumed run purges the events after its
  checkpoint, so the curve has no duplicate steps.
- ``wandb``: offline runs in ``<out>/wandb/`` (``wandb sync`` uploads them later); set
  ``WANDB_MODE=online`` to stream. Project ``$WANDB_PROJECT`` (default ``gradzip``), group: the
  sweep's name for sweep cells. A resumed run continues the same W&B run id.
- ``mlflow``: a local file store ``<out>/../mlruns`` for sweep cells (one store per sweep, one
  MLflow run per cell) or ``<out>/mlruns`` for a lone run, unless ``$MLFLOW_TRACKING_URI`` is set.
  Experiment: the sweep's name, else ``gradzip``.

A new sink is a class with ``log(record)`` and ``close()``, constructed from
``(out, name, group, hparams, start_step)``, added to :data:`SINKS`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from gradzip.errors import GradzipError

# name -> (module that must import, extra to install)
REQUIRES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow")}
# Config keys that are not hyper-parameters (paths, cadence, per-invocation switches).
NOT_HPARAMS = frozenset({"out", "resume", "config", "progress", "stop_at", "timeout", "log", "keep_checkpoints",
                         "checkpoint_every"})


class Sink(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def parse_log(text: str | None) -> list[str]:
    """``"tensorboard,wandb"`` -> the sink names; ``None``, ``""`` or ``"none"`` -> none.

    Raises GradzipError naming an unknown sink."""
    if text is None or text.strip().lower() in ("", "none"):
        return []
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    for n in names:
        if n not in REQUIRES:
            raise GradzipError(f"--log: unknown logger {n!r}; use tensorboard, wandb or mlflow (comma-separated), "
                               "or none")
    return list(dict.fromkeys(names))


def check_available(names: list[str]) -> None:
    """Raise GradzipError (with the install command) for a sink whose package is missing."""
    for n in names:
        module, extra = REQUIRES[n]
        if importlib.util.find_spec(module) is None:
            raise GradzipError(f"--log {n} needs the {module} package: pip install 'gradzip[{extra}]'")


def tag(key: str) -> str:
    """The chart name of a record field: ``eval_mlm_acc`` -> ``eval/mlm_acc``, ``bytes_sent`` ->
    ``comm/bytes_sent``, ``compute_s`` -> ``time/compute_s``, the rest under ``train/``."""
    if key.startswith("eval_"):
        return "eval/" + key[5:]
    if key.startswith("bytes"):
        return "comm/" + key
    if key.endswith("_s"):
        return "time/" + key
    return "train/" + key


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric fields by chart name (``step`` and text fields left out; true = 1)."""
    out = {}
    for k, v in record.items():
        if k == "step" or v is None or isinstance(v, str):
            continue
        if isinstance(v, (bool, int, float)):
            out[tag(k)] = float(v)
    return out


def hparams_of(config: dict[str, Any]) -> dict[str, bool | int | float | str]:
    """A run configuration as flat hyper-parameters (None as the text ``none``)."""
    return {k: ("none" if v is None else v) for k, v in config.items()
            if k not in NOT_HPARAMS and (v is None or isinstance(v, (bool, int, float, str)))}


class TensorBoardSink:
    def __init__(self, out: Path, name: str, group: str | None, hparams: dict[str, Any], start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        # purge_step drops events logged past the checkpoint by the interrupted attempt
        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        if not start_step:
            metrics = {"eval/loss": 0.0, "eval/mlm_acc": 0.0, "eval/nsp_acc": 0.0, "train/loss": 0.0}
            for s in hparams_summary(hparams, metrics):  # experiment, session start and end summaries
                self.writer.file_writer.add_summary(s)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for k, v in scalars(record).items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandbSink:
    def __init__(self, out: Path, name: str, group: str | None, hparams: dict[str, Any], start_step: int) -> None:
        import wandb

        run_id = hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:16]  # stable: a resume continues the run
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "gradzip"), name=name, group=group,
                              config=hparams, dir=str(out), id=run_id, resume="allow",
                              mode=os.environ.get("WANDB_MODE", "offline"), reinit="create_new")

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    def __init__(self, out: Path, name: str, group: str | None, hparams: dict[str, Any], start_step: int) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the local file store (MLflow 3 asks for this opt-in; a database needs a server-side extra)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (out.parent / "mlruns" if group else out / "mlruns").resolve().as_uri()
        self.client = MlflowClient(uri)
        experiment = group or "gradzip"
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        id_file = out / "mlflow_run_id"
        if start_step and id_file.exists():  # resume: continue the same MLflow run
            self.run_id = id_file.read_text().strip()
            return
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        id_file.write_text(self.run_id + "\n")
        self.client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in hparams.items()])

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(record["step"])
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars(record).items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


SINKS: dict[str, Callable[..., Sink]] = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MlflowSink}


def sweep_name(out: Path) -> str | None:
    """The sweep a run directory belongs to (its parent holds ``sweep.json``), else None."""
    return out.resolve().parent.name if (out.parent / "sweep.json").exists() else None


def open_sinks(names: list[str], out: Path, config: dict[str, Any], start_step: int) -> list[Sink]:
    """One sink per name for the run in ``out`` (its name: the directory's), resumed at ``start_step``."""
    group = sweep_name(out)
    hp = hparams_of(config)
    sinks: list[Sink] = []
    try:
        for n in names:
            try:
                sinks.append(SINKS[n](out, out.resolve().name, group, hp, start_step))
            except Exception as e:  # the package's own error, in one line
                raise GradzipError(f"--log {n}: could not start the logger: {str(e).splitlines()[0] if str(e) else e!r}"
                                   ) from None
    except GradzipError:
        for s in sinks:
            s.close()
        raise
    return sinks
