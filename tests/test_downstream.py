"""Sweeps that speak downstream (gradzip.experiments.downstream): a ``[downstream]`` table exports and
fine-tunes every cell after its pretraining; ``gradzip plot`` draws accuracy against bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradzip.cli import main
from gradzip.errors import SpecError
from gradzip.experiments.spec import load_spec

BASE = """
[base]
model = "bert-tiny"
backend = "sim"
workers = 2
vocab_size = 512
seq_len = 32
batch_size = 4
steps = 2
eval_every = 2
eval_batches = 1
checkpoint_every = 2
lr = 2e-3
warmup = 1
progress = false
"""


def write(path: Path, body: str) -> Path:
    path.write_text(body, encoding="utf-8")
    return path


def test_a_sweep_chains_pretraining_export_and_finetuning(tmp_path, corpus, capsys):
    spec = write(tmp_path / "down.toml", f"""name = "down"
description = "two compressors, fine-tuned"
{BASE}
corpus = "{corpus}"
[grid]
compressor = ["none", "topk:ratio=0.1,ef=true"]
[downstream]
task = "keywords"
seeds = 2
epochs = 1
batch_size = 8
seq_len = 32
examples = [32, 16]
""")
    out = tmp_path / "sweep"
    assert main(["sweep", str(spec), "--out", str(out)]) == 0
    assert "downstream: accuracy" in capsys.readouterr().out
    for cell in ("compressor=none", "compressor=topk-ratio=0.1-ef=true"):
        d = out / cell / "downstream"
        s = json.loads((d / "summary.json").read_text())
        assert len(s["seeds"]) == 2 and 0.0 <= s["accuracy"] <= 1.0 and s["task"] == "keywords"
        per_seed = [json.loads((d / f"seed={k}" / "summary.json").read_text())["accuracy"] for k in range(2)]
        assert s["accuracy"] == pytest.approx(sum(per_seed) / 2)
        assert s["bytes_total"] == json.loads((out / cell / "summary.json").read_text())["bytes_total"]
        assert (d / "hf" / "model.safetensors").is_file() and (d / "task" / "train.jsonl").is_file()
    # a re-run skips what is finished, fine-tunes included
    stamp = (out / "compressor=none" / "downstream" / "seed=0" / "summary.json").stat().st_mtime_ns
    assert main(["sweep", str(spec), "--out", str(out)]) == 0
    assert (out / "compressor=none" / "downstream" / "seed=0" / "summary.json").stat().st_mtime_ns == stamp
    # another recipe never reuses (or overwrites) a seed fine-tuned with the old one
    write(spec, spec.read_text().replace("epochs = 1", "epochs = 2"))
    capsys.readouterr()
    main(["sweep", str(spec), "--out", str(out)])
    assert "fine-tuned with other settings (epochs differ from [downstream])" in capsys.readouterr().out
    assert (out / "compressor=none" / "downstream" / "seed=0" / "summary.json").stat().st_mtime_ns == stamp
    assert main(["plot", str(out), "--figures", "downstream_vs_bytes"]) == 0
    assert (out / "figures" / "downstream_vs_bytes.png").stat().st_size > 10_000


@pytest.mark.parametrize(("table", "words"), [
    ("task = \"glue\"", "task must be \"keywords\""),
    ("train = \"a.jsonl\"", "needs both train and validation"),
    ("seeds = 0", "seeds, epochs, batch_size >= 1"),
    ("bogus = 1", "[downstream] has no key 'bogus'"),
])
def test_bad_downstream_tables_are_one_line(tmp_path, table, words):
    spec = write(tmp_path / "bad.toml", f"{BASE}\n[grid]\nseed = [0]\n[downstream]\n{table}\n")
    with pytest.raises(SpecError) as e:
        load_spec(spec)
    assert words in str(e.value) and "\n" not in str(e.value)
