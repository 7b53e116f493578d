"""Bad input, table-driven: each case runs the real ``gradzip`` entry point in this process and must
exit 2 with one line on stderr that names the problem, print no traceback, and leave every file
in the working directory as it was (compared by SHA-256)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from gradzip.cli import main

SIM = ["simulate", "--tokens-per-second", "5600"]
TEXT = "".join(f"Document {i} says a few words about training. And another sentence.\n\n" for i in range(8))
TRAIN = ["train", "--model", "bert-tiny", "--seq-len", "32", "--batch-size", "2", "--steps", "2", "--no-progress"]

# (id, argv, environment, files to create {name: text}, a fragment of the message)
CASES = [
    ("rank-negative", TRAIN + ["--backend", "gloo"], {"RANK": "-1", "WORLD_SIZE": "2"}, {},
     "RANK=-1 is outside 0..1"),
    ("rank-too-big", TRAIN + ["--backend", "gloo"], {"RANK": "5", "WORLD_SIZE": "2"}, {}, "RANK=5 is outside 0..1"),
    ("world-zero", TRAIN + ["--backend", "gloo"], {"RANK": "0", "WORLD_SIZE": "0"}, {},
     "WORLD_SIZE=0 from the torchrun environment"),
    ("rank-not-int", TRAIN + ["--backend", "gloo"], {"RANK": "one", "WORLD_SIZE": "2"}, {},
     "RANK='one' is not an integer"),
    ("port-out-of-range", TRAIN + ["--backend", "gloo"], {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "99999"},
     {}, "MASTER_PORT=99999 is not a TCP port"),
    ("master-addr-unresolvable", TRAIN + ["--backend", "gloo"],
     {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29511"}, {},
     "MASTER_ADDR='no-such-host.invalid' does not resolve"),
    ("mpi-rank-too-big", TRAIN + ["--backend", "gloo"], {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "2"},
     {}, "OMPI_COMM_WORLD_RANK/PMI_RANK=3 is outside 0..1"),
    ("slurm-world-negative", TRAIN + ["--backend", "gloo"], {"SLURM_PROCID": "0", "SLURM_NTASKS": "-4"}, {},
     "SLURM_NTASKS=-4"),
    ("toml-two-spellings", ["train", "--config", "c.toml"], {}, {"c.toml": "batch_size = 4\nbatch-size = 8\n"},
     "'batch_size' and 'batch-size' are the same setting"),
    ("toml-unknown-key", ["train", "--config", "c.toml"], {}, {"c.toml": "batchsize = 4\n"},
     "unknown key 'batchsize'"),
    ("toml-table", ["train", "--config", "c.toml"], {}, {"c.toml": "[model]\nname = 'x'\n"}, "tables are not allowed"),
    ("toml-broken", ["train", "--config", "c.toml"], {}, {"c.toml": "steps = [\n"}, "not valid TOML"),
    ("toml-wrong-type", ["train", "--config", "c.toml"], {}, {"c.toml": "steps = 'many'\n"}, "steps must be"),
    ("config-missing", ["train", "--config", "missing.toml"], {}, {}, "missing.toml"),
    ("out-is-a-file", TRAIN + ["--out", "f.txt"], {}, {"f.txt": "mine"}, "exists and is not a directory"),
    ("out-not-empty", TRAIN + ["--out", "d"], {}, {"d/keep.txt": "mine"}, "exists and is not empty"),
    ("resume-nothing", TRAIN + ["--out", "d", "--resume"], {}, {"d/keep.txt": "mine"}, "holds no checkpoint"),
    ("unknown-compressor", TRAIN + ["--compressor", "zip9"], {}, {}, "unknown compressor 'zip9'"),
    ("compressor-space-not-comma", TRAIN + ["--compressor", "topk:ratio=0.01 ef=true"], {}, {},
     "has a space inside 'ratio=0.01 ef=true': separate parameters with commas, e.g. topk:ratio=0.01,ef=true"),
    ("resume-missing-out", TRAIN + ["--out", "no-such-run", "--resume"], {}, {}, "does not exist, so there is no run"),
    ("compressor-bad-param", TRAIN + ["--compressor", "topk:ratio=2"], {}, {}, "topk"),
    ("compressor-unknown-param", TRAIN + ["--compressor", "topk:k=3"], {}, {}, "unknown parameter"),
    ("unknown-exchange", TRAIN + ["--compressor", "onebit", "--exchange", "ring"], {}, {},
     "--exchange: onebit: unknown exchange scheme 'ring'; onebit supports exchange=allgather|twophase"),
    ("exchange-unsupported", TRAIN + ["--compressor", "powersgd:exchange=twophase"], {}, {},
     "powersgd does not support exchange 'twophase'"),
    ("exchange-disagrees", TRAIN + ["--compressor", "onebit:exchange=allgather", "--exchange", "twophase"], {}, {},
     "set the scheme in one place"),
    ("simulate-unsupported-exchange", SIM + ["--compressor", "none:exchange=twophase"], {}, {},
     "none does not support exchange"),
    ("unknown-model", TRAIN + ["--model", "bert-gigantic"], {}, {}, "--model"),
    ("netem-with-sim", TRAIN + ["--netem", "2:1gbit"], {}, {}, "needs --backend gloo or mpi"),
    ("netem-spelling", TRAIN + ["--backend", "gloo", "--netem", "2:fast"], {}, {}, "--netem"),
    ("netem-trace-without-netem", TRAIN + ["--backend", "gloo", "--netem-trace", "10gbit-100mbit-30s"], {}, {},
     "--netem-trace 10gbit-100mbit-30s plays on the network testbed: it needs --netem"),
    ("netem-trace-missing", TRAIN + ["--backend", "gloo", "--netem", "2:1gbit", "--netem-trace", "no.txt"], {}, {},
     "--netem-trace no.txt: no such file, nor a shipped trace of that name; shipped: 10gbit-100mbit-30s"),
    ("netem-trace-bad-row", TRAIN + ["--backend", "gloo", "--netem", "2:1gbit", "--netem-trace", "l.txt"], {},
     {"l.txt": "0, 1gbit\n5, fast\n"}, "l.txt:2: cannot parse bandwidth 'fast'"),
    ("netem-trace-in-config", ["train", "--config", "c.toml"], {},
     {"c.toml": "backend = 'gloo'\nnetem = '2:1gbit'\nnetem_trace = 'l.txt'\n", "l.txt": "3, 1gbit\n"},
     "l.txt:1: the first row must be at time 0"),
    ("netem-unshaped-with-delay", TRAIN + ["--backend", "gloo", "--netem", "2:unshaped:1ms"], {}, {},
     "--netem: an unshaped link takes no delay or loss"),
    ("bandwidth-unshaped-on-sim", TRAIN + ["--bandwidth", "unshaped"], {}, {}, "unshaped names a testbed link"),
    ("negative-steps", TRAIN + ["--steps", "-3"], {}, {}, "steps"),
    ("seq-len-too-long", TRAIN + ["--seq-len", "4096"], {}, {}, "must be <= 512"),
    ("bandwidth-garbage", TRAIN + ["--bandwidth", "fast"], {}, {}, "bandwidth"),
    ("nccl-on-cpu", TRAIN + ["--backend", "nccl"], {}, {}, "nccl"),
    ("simulate-bad-bandwidth", SIM + ["--inter-bandwidth", "lots"], {}, {}, "bandwidth"),
    ("simulate-bad-overlap", SIM + ["--overlap", "1.5"], {}, {}, "--overlap must be in [0, 1]"),
    ("simulate-unknown-compressor", SIM + ["--compressor", "zip9"], {}, {}, "unknown compressor"),
    ("plot-missing-dir", ["plot", "nowhere"], {}, {}, "nowhere"),
    ("sweep-missing-spec", ["sweep", "nope.toml"], {}, {}, "nope.toml"),
    ("run-unknown-spec", ["run", "no-such-spec"], {}, {}, "no-such-spec"),
    ("bench-compress-bad-numel", ["bench", "compress", "--numel", "0"], {}, {}, "numel"),
    ("netem-bad-rate", ["netem", "up", "--prefix", "badin", "--rate=-1gbit"], {}, {}, "bandwidth must be positive"),
    ("simulate-missing-flag", ["simulate"], {}, {}, "--tokens-per-second"),
    ("train-unknown-flag", ["train", "--learning-rate", "1"], {}, {}, "unrecognized arguments"),
    ("out-under-proc", TRAIN + ["--corpus", "c.txt", "--out", "/proc/gradzip-no-such-dir/run"], {},
     {"c.txt": TEXT}, "cannot create it"),
    ("out-parent-is-a-file", TRAIN + ["--corpus", "c.txt", "--out", "f.txt/run"], {},
     {"c.txt": TEXT, "f.txt": "mine"}, "cannot create it (Not a directory)"),
    ("simulate-encode-cost-dir", SIM + ["--compressor", "topk", "--encode-cost", "d"], {}, {"d/keep.txt": "x"},
     "--encode-cost d: cannot read it"),
    ("simulate-encode-cost-binary", SIM + ["--compressor", "topk", "--encode-cost", "b.json"], {},
     {"b.json": b"\x00\xff\xfe"}, "is not JSON"),
    ("plot-binary-metrics", ["plot", "r"], {}, {"r/metrics.jsonl": b"\x00\xff\xfe", "r/summary.json": "{}"},
     "r/metrics.jsonl is not a JSON-lines text file"),
    ("plot-summary-not-an-object", ["plot", "r"], {}, {"r/summary.json": "[1, 2]", "r/metrics.jsonl": '{"step": 1}\n'},
     "holds a JSON list, not the object gradzip writes"),
    ("resume-binary-metrics", TRAIN + ["--out", "r", "--resume"], {}, {"r/metrics.jsonl": b"\x00\xff"},
     "holds no checkpoint"),
    ("ranks-per-node-zero", TRAIN + ["--ranks-per-node", "0"], {}, {}, "--ranks-per-node must be >= 1"),
    ("ranks-per-node-uneven", TRAIN + ["--workers", "6", "--ranks-per-node", "4", "--hierarchical"], {}, {},
     "--ranks-per-node 4 does not divide --workers 6"),
    ("intra-bandwidth-garbage", TRAIN + ["--intra-bandwidth", "fast"], {}, {}, "cannot parse bandwidth 'fast'"),
    ("intra-dtype-unknown", TRAIN + ["--intra-dtype", "int8"], {}, {}, "invalid choice: 'int8'"),
    ("exchange-sparse-for-a-cast", TRAIN + ["--compressor", "fp16:exchange=sparse"], {}, {},
     "fp16 does not support exchange 'sparse'"),
    ("simulate-exchange-unknown", SIM + ["--compressor", "topk:exchange=ring"], {}, {}, "unknown exchange scheme"),
    ("simulate-zero-nodes", SIM + ["--nodes", "0"], {}, {}, "--nodes and --gpus-per-node must be >= 1"),
    ("corpus-empty-dir", TRAIN + ["--corpus", "d"], {}, {"d/x.bin": "not text"}, "contains no text files"),
    ("tokenizer-is-a-dir", TRAIN + ["--corpus", "c.txt", "--tokenizer", "d"], {},
     {"c.txt": TEXT, "d/keep.txt": "x"}, "tokenizer file d"),
    ("config-is-a-dir", ["train", "--config", "d"], {}, {"d/keep.txt": "x"}, "cannot read config file 'd'"),
    ("config-exchange-disagrees", ["train", "--config", "c.toml"], {},
     {"c.toml": 'compressor = "onebit:exchange=allgather"\nexchange = "twophase"\n'}, "set the scheme in one place"),
    ("netem-bad-subnet", ["netem", "up", "--prefix", "badin", "--subnet", "192.168.0.0/24"], {}, {},
     "outside the benchmarking range"),
    ("max-skips-negative", TRAIN + ["--max-skips", "-1"], {}, {}, "--max-skips must be >= 0"),
    ("mask-prob-one", TRAIN + ["--mask-prob", "1"], {}, {}, "--mask-prob must be in (0, 1)"),
    ("freeze-step-zero", TRAIN + ["--optimizer", "onebit-adam", "--freeze-step", "0"], {}, {},
     "--freeze-step must be a whole number of steps >= 1 or a fraction in (0, 1)"),
    ("freeze-step-not-whole", TRAIN + ["--optimizer", "onebit-lamb", "--freeze-step", "2.5"], {}, {},
     "--freeze-step must be a whole number"),
    ("ef-neither-bool-nor-ef21", TRAIN + ["--compressor", "topk:ef=ef22"], {}, {}, "is not one of true, false or ef21"),
    ("ef21-for-an-unbiased-compressor", TRAIN + ["--compressor", "randomk:ef=ef21"], {}, {},
     "ef=ef21 is for biased compressors"),
    ("demo-optimizer-other-compressor", TRAIN + ["--optimizer", "demo", "--compressor", "topk:ratio=0.01"], {}, {},
     "--optimizer demo needs the demo compressor"),
    ("demo-compressor-other-optimizer", TRAIN + ["--compressor", "demo:topk=16"], {}, {},
     "--compressor demo:topk=16 needs --optimizer demo"),
    ("demo-chunk-too-big", TRAIN + ["--optimizer", "demo", "--compressor", "demo:chunk=512"], {}, {},
     "demo: chunk must be in [1, 256]"),
    ("demo-unknown-param", TRAIN + ["--optimizer", "demo", "--compressor", "demo:k=3"], {}, {},
     "demo: unknown parameter(s) k; valid parameters: topk, chunk, decay"),
    ("sparseloco-with-compressor", TRAIN + ["--sync", "sparseloco", "--compressor", "topk:ratio=0.01"], {}, {},
     "--sync sparseloco sends its own codec"),
    ("sparseloco-outer-lr", TRAIN + ["--sync", "sparseloco:outer_lr=0.7"], {}, {},
     "--sync sparseloco has no parameter 'outer_lr'"),
    ("sparseloco-momentum", TRAIN + ["--sync", "sparseloco:every=4,momentum=0.9"], {}, {},
     "--sync sparseloco has no parameter 'momentum'"),
    ("sparseloco-k-above-chunk", TRAIN + ["--sync", "sparseloco:chunk=8,k=65"], {}, {},
     "--sync sparseloco: k must be in [1, chunk²] = [1, 64]; got 65"),
    ("sparseloco-bits", TRAIN + ["--sync", "sparseloco:bits=9"], {}, {}, "sparseloco: bits must be in [1, 8]; got 9"),
    ("sparseloco-chunk-zero", TRAIN + ["--compressor", "sparseloco:chunk=0"], {}, {},
     "sparseloco: chunk must be in [1, 64] (positions take 12 bits); got 0"),
    ("sparseloco-beta", TRAIN + ["--sync", "sparseloco:beta=1.5"], {}, {}, "beta=1.5 must be in [0, 1]"),
    ("sparseloco-k-above-default-chunk", TRAIN + ["--sync", "sparseloco:k=4097"], {}, {},
     "--sync sparseloco: k must be in [1, chunk²] = [1, 4096]; got 4097"),
    ("sparseloco-bits-zero", TRAIN + ["--sync", "sparseloco:bits=0"], {}, {},
     "sparseloco: bits must be in [1, 8]; got 0"),
    ("sparseloco-sync-chunk-zero", TRAIN + ["--sync", "sparseloco:chunk=0"], {}, {},
     "--sync sparseloco: chunk must be in [1, 64] (positions take 12 bits); got 0"),
    ("sparseloco-with-exchange", TRAIN + ["--sync", "sparseloco", "--exchange", "allgather"], {}, {},
     "--sync sparseloco sends its own codec"),
    ("sparseloco-ef-dtype", TRAIN + ["--sync", "sparseloco:ef_dtype=fp16"], {}, {},
     "ef_dtype='fp16' must be fp32 or bf16"),
    ("sparseloco-hsdp-overlap", TRAIN + ["--backend", "gloo", "--workers", "4", "--hsdp", "--ranks-per-node", "2",
                                          "--sync", "sparseloco:overlap=1"], {}, {},
     "--hsdp with --sync sparseloco waits for each sync's exchange: drop overlap=1"),
    ("sparseloco-fsdp", TRAIN + ["--backend", "gloo", "--workers", "2", "--fsdp", "--sync", "sparseloco"], {}, {},
     "--sync sparseloco runs sharded with --hsdp"),
    ("sparseloco-ef-dtype-flag", TRAIN + ["--sync", "sparseloco", "--ef-dtype", "bf16"], {}, {},
     "--sync sparseloco keeps its memory in bf16 with --sync sparseloco:ef_dtype=bf16"),
    ("overlap-without-outer-step", TRAIN + ["--sync", "step:overlap=1"], {}, {},
     "--sync step has no outer step to overlap"),
    ("overlap-two-rounds", TRAIN + ["--sync", "diloco:every=4,overlap=2"], {}, {}, "overlap=2 must be 0 or 1"),
    ("fault-unknown-kind", TRAIN, {"GRADZIP_FAULT": "boom:step=1"}, {}, "unknown fault 'boom'"),
    ("fault-without-step", TRAIN, {"GRADZIP_FAULT": "nan:rank=1"}, {}, "step= is required"),
    ("fault-delay-without-seconds", TRAIN, {"GRADZIP_FAULT": "delay:step=2"}, {}, "delay needs seconds= > 0"),
    ("fault-step-range-reversed", TRAIN, {"GRADZIP_FAULT": "inf:step=5-2"}, {}, "A <= B"),
    ("simulate-encode-cost-numel-not-a-number", SIM + ["--compressor", "topk", "--encode-cost", "b.json"], {},
     {"b.json": '[{"name": "topk", "spec": "topk", "numel": "many", "time_s": 1e-6}]'},
     "--encode-cost file b.json: row topk: numel must be a number, got 'many'"),
    ("simulate-encode-cost-time-not-a-number", SIM + ["--compressor", "fp16", "--encode-cost", "b.json"], {},
     {"b.json": '[{"name": "fp16", "numel": 1000, "compress_s": [1], "decompress_s": 2e-6}]'},
     "row fp16: compress_s must be a number"),
]

LAUNCHER_VARS = ("GRADZIP_FAULT",  # a fault set outside the suite must not reach these runs
                 "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
                 "SLURM_STEP_NUM_TASKS", "GRADZIP_LAUNCHER")


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("argv, env, files, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(argv, env, files, needle, tmp_path, monkeypatch, capsys):
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):  # binary junk where gradzip expects text
            (tmp_path / name).write_bytes(text)
        else:
            (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    before = _hashes(tmp_path)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors (unknown or missing flags): one line, exit 2
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, f"exit {code}, stderr: {err[-2000:]}"
    assert err.count("\n") == 1 and err.endswith("\n"), f"not one line: {err!r}"
    assert "Traceback" not in err and needle in err, err
    assert _hashes(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({Path(n).parts[0] for n in files})


def test_unreadable_corpus_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """``--corpus FILE`` that cannot be opened (permissions: simulated, since root reads any file)."""
    import builtins

    from gradzip.data import corpus

    def refuse(path, *args, **kwargs):
        if Path(path).name == "c.txt":
            raise PermissionError(13, "Permission denied", str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(corpus, "open", refuse, raising=False)
    test_bad_input_is_one_line_exit_2_and_changes_nothing(
        TRAIN + ["--corpus", "c.txt"], {}, {"c.txt": TEXT}, "cannot read corpus file c.txt (Permission denied)",
        tmp_path, monkeypatch, capsys)
