"""`gradzip train --log`: live-curve sinks stream the records of metrics.jsonl. TensorBoard is read
back with tensorboard's own event reader; MLflow with its client; W&B through a recording stand-in
(its offline files have no Python reader) plus one real offline run when wandb is installed."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path

import pytest

from gradzip.cli import main
from gradzip.errors import GradzipError
from gradzip.training import loggers
from gradzip.training.metrics import read_metrics

TINY = ["--seq-len", "64", "--batch-size", "4", "--workers", "2", "--eval-batches", "2", "--eval-every", "3",
        "--warmup", "2", "--steps", "6", "--no-progress"]


def events(run: Path):
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    ea = ea_mod.EventAccumulator(str(run / "tensorboard"))
    ea.Reload()
    return ea


def series(ea, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in ea.Scalars(tag)}


def test_tensorboard_events_equal_metrics_jsonl(tmp_path, corpus):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    assert main(["train", *TINY, "--corpus", str(corpus), "--compressor", "topk:ratio=0.1,ef=true",
                 "--log", "tensorboard", "--out", str(out)]) == 0
    ea = events(out)
    recs = read_metrics(out / "metrics.jsonl")
    for key, tag in [("loss", "train/loss"), ("lr", "train/lr"), ("bytes_sent", "comm/bytes_sent"),
                     ("compute_s", "time/compute_s"), ("eval_mlm_acc", "eval/mlm_acc"), ("eval_loss", "eval/loss")]:
        want = {r["step"]: r[key] for r in recs if r.get(key) is not None}
        got = series(ea, tag)
        assert sorted(got) == sorted(want), tag
        assert all(got[s] == pytest.approx(want[s], rel=1e-6) for s in want), tag
    assert sorted(series(ea, "eval/nsp_acc")) == [3, 6]
    # the configuration is in the HParams tab, with the eval metrics as its columns
    from tensorboard.plugins.hparams import plugin_data_pb2
    content = ea.PluginTagToContent("hparams")
    data = {tag: plugin_data_pb2.HParamsPluginData.FromString(c) for tag, c in content.items()}
    start = next(d.session_start_info for d in data.values() if d.HasField("session_start_info"))
    assert start.hparams["compressor"].string_value == "topk:ratio=0.1,ef=true"
    assert start.hparams["steps"].number_value == 6
    exp = next(d.experiment for d in data.values() if d.HasField("experiment"))
    assert {m.name.tag for m in exp.metric_infos} >= {"eval/loss", "eval/mlm_acc"}


def test_tensorboard_resume_purges_the_steps_after_the_checkpoint(tmp_path, corpus, monkeypatch):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    args = ["train", *TINY, "--corpus", str(corpus), "--log", "tensorboard", "--checkpoint-every", "3",
            "--out", str(out)]
    monkeypatch.setenv("GRADZIP_FAULT", "raise:step=6")  # logs steps 1-5, checkpoint at 3
    with pytest.raises(Exception, match="injected exception at step 6"):
        main(args)
    assert sorted(series(events(out), "train/loss")) == [1, 2, 3, 4, 5]
    monkeypatch.delenv("GRADZIP_FAULT")
    assert main([*args, "--resume"]) == 0
    got = series(events(out), "train/loss")
    want = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl")}
    assert sorted(got) == [1, 2, 3, 4, 5, 6]  # 4 and 5 of the first attempt are gone, not doubled
    assert all(got[s] == pytest.approx(want[s], rel=1e-6) for s in want)


def test_sweep_logs_each_cell_as_its_own_run(tmp_path, corpus):
    pytest.importorskip("tensorboard")
    spec = tmp_path / "s.toml"
    spec.write_text(f'name = "tb"\n[base]\ncorpus = "{corpus}"\nseq_len = 64\nbatch_size = 4\nworkers = 2\n'
                    'steps = 3\neval_every = 3\neval_batches = 1\nlog = "tensorboard"\nprogress = false\n'
                    '[grid]\ncompressor = ["none", "onebit"]\n')
    assert main(["sweep", str(spec), "--out", str(tmp_path / "sw"), "--in-process", "--no-plot"]) == 0
    from tensorboard.plugins.hparams import plugin_data_pb2
    seen = {}
    for cell in ("compressor=none", "compressor=onebit"):
        ea = events(tmp_path / "sw" / cell)
        assert sorted(series(ea, "train/loss")) == [1, 2, 3]
        data = [plugin_data_pb2.HParamsPluginData.FromString(c) for c in ea.PluginTagToContent("hparams").values()]
        start = next(d.session_start_info for d in data if d.HasField("session_start_info"))
        seen[cell] = start.hparams["compressor"].string_value
    assert seen == {"compressor=none": "none", "compressor=onebit": "onebit"}


def test_mlflow_run_has_the_params_and_every_step(tmp_path, corpus):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    out = tmp_path / "run"
    assert main(["train", *TINY, "--corpus", str(corpus), "--log", "mlflow", "--out", str(out)]) == 0
    client = MlflowClient((out / "mlruns").resolve().as_uri())
    run = client.get_run((out / "mlflow_run_id").read_text().strip())
    assert run.data.params["compressor"] == "none" and run.info.status == "FINISHED"
    recs = read_metrics(out / "metrics.jsonl")
    hist = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert hist == pytest.approx({r["step"]: r["loss"] for r in recs})
    acc = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/mlm_acc")}
    assert acc == pytest.approx({r["step"]: r["eval_mlm_acc"] for r in recs if "eval_mlm_acc" in r})


class FakeWandb(types.ModuleType):
    """Records what the sink hands to wandb."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # importable, as far as find_spec knows
        self.inits: list[dict] = []
        self.logged: list[tuple[dict, int]] = []
        self.finished = 0

    def init(self, **kw):
        self.inits.append(kw)
        fake = self

        class Run:
            def log(self, data, step):
                fake.logged.append((data, step))

            def finish(self):
                fake.finished += 1
        return Run()


def test_wandb_sink_logs_config_and_records(tmp_path, corpus, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = tmp_path / "run"
    assert main(["train", *TINY, "--corpus", str(corpus), "--log", "wandb", "--out", str(out)]) == 0
    (init,) = fake.inits
    assert init["mode"] == "offline" and init["dir"] == str(out) and init["config"]["seed"] == 0
    recs = read_metrics(out / "metrics.jsonl")
    assert [s for _, s in fake.logged] == [r["step"] for r in recs]
    assert [d["train/loss"] for d, _ in fake.logged] == pytest.approx([r["loss"] for r in recs])
    assert fake.finished == 1


def test_real_wandb_offline_run(tmp_path, corpus, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--corpus", str(corpus), "--log", "wandb", "--out", str(out)]) == 0
    files = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1 and files[0].stat().st_size > 0


def test_bad_log_names_and_missing_packages(tmp_path, capsys, monkeypatch):
    assert loggers.parse_log("tensorboard, mlflow,tensorboard") == ["tensorboard", "mlflow"]
    assert loggers.parse_log("none") == [] and loggers.parse_log(None) == []
    out = tmp_path / "run"
    assert main(["train", "--log", "tensorbord", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown logger 'tensorbord'" in err and "\n" not in err and not out.exists()
    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(GradzipError, match=r"--log wandb needs the wandb package: pip install 'gradzip\[wandb\]'"):
        loggers.check_available(["wandb"])
    assert main(["train", "--log", "mlflow", "--out", str(out)]) == 2
    assert "pip install 'gradzip[mlflow]'" in capsys.readouterr().err and not out.exists()


def test_tags_and_scalars():
    rec = {"step": 3, "loss": 7.0, "eval_mlm_acc": 0.25, "bytes_sent": 10, "comm_s": 0.5, "clock": "modelled",
           "skipped": True, "grad_norm": None}
    assert loggers.scalars(rec) == {"train/loss": 7.0, "eval/mlm_acc": 0.25, "comm/bytes_sent": 10.0,
                                    "time/comm_s": 0.5, "train/skipped": 1.0}
