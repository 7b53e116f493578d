"""``gradzip simulate --sync sparseloco``: the command accepts the registered mode, prices the
mode's own codec over every parameter (its exact payload, by allgather), and refuses a
``--compressor`` as ``gradzip train`` does; the LLaMA-style shapes it sizes a 70 B model with."""

from __future__ import annotations

import json
import math

import pytest

from gradzip.cli import main
from gradzip.cluster import simulate as sim
from gradzip.cluster.models import DECODERS, model_shapes
from gradzip.compress.registry import create
from gradzip.engine.modes import load_modes
from gradzip.engine.sparseloco import codec_spec
from gradzip.plan.sync import mode_codec, parse_sync

ARGS = ["simulate", "--model", "bert-tiny", "--nodes", "4", "--gpus-per-node", "1", "--tokens-per-second", "1000",
        "--inter-bandwidth", "100mbit", "--latency", "0us"]


def test_the_cli_accepts_sparseloco_and_sends_its_codec_over_every_parameter(capsys):
    """The payload of one sync is the codec's ``payload_bytes`` of each parameter's own shape,
    small ones included; a ring allgather among 4 sends 3 others' payloads per rank."""
    assert main([*ARGS, "--sync", "sparseloco", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["results"][0]
    codec = codec_spec(parse_sync("sparseloco"))
    comp = create(codec)
    want = sum(comp.payload_bytes(s) for s in model_shapes("bert-tiny").values())
    assert r["compressor"] == comp.spec and r["exchange"] == "allgather" and r["sync"].startswith("sparseloco:every=30")
    assert r["bytes_per_sync"] == want and r["payload_bytes"] == pytest.approx(want / 30)
    assert r["sent_bytes"] == pytest.approx(3 * want / 30)
    assert r["detail"]["compressed_elements"] == sum(math.prod(s) for s in model_shapes("bert-tiny").values())
    # no latency, so the link time is the bytes: 3 payloads in through each rank's 100 Mbit/s
    assert r["comm_s"] * 30 == pytest.approx(3 * want * 8 / 1e8)
    assert r["compute_utilisation"] == pytest.approx(30 * r["compute_s"] / (30 * r["compute_s"] + r["comm_s"] * 30))


def test_sparseloco_prices_what_its_codec_spec_says():
    load_modes()
    sync = parse_sync("sparseloco:every=10,k=32,bits=3")
    assert mode_codec(sync) == codec_spec(sync) and mode_codec(parse_sync("diloco:every=4")) is None
    w, cl = sim.Workload("bert-tiny", 1000.0, 8, 64), sim.Cluster(2, 1, 1e8, 1e10, 0.0, 0.0)
    p = sim.predict("none", w, cl, sync=sync)
    comp = create(codec_spec(sync))
    assert p.bytes_per_sync == sum(comp.payload_bytes(s) for s in model_shapes("bert-tiny").values())
    assert sim.predict(codec_spec(sync), w, cl, sync=sync) == p  # the codec itself is the same cell


@pytest.mark.parametrize("extra, needle", [
    (["--sync", "sparseloco", "--compressor", "topk:ratio=0.01,ef=true"], "drop --compressor topk"),
    (["--sync", "sparseloco:k=5000"], "--sync sparseloco: k must be in [1, chunk²]"),
    (["--sync", "sparseloco:beta=2"], "beta=2 must be in [0, 1]"),
])
def test_bad_sparseloco_exits_2_with_one_line(extra, needle, capsys):
    assert main([*ARGS, *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_llama_70b_costs_0_219_bits_per_parameter_plus_the_tables():
    """Every matrix of Llama-3-70B's shapes has sides divisible by 64: 4,096-element chunks of 64
    entries, 12 + 2 bits each (112 bytes a chunk); each 1-D norm weight is cut into runs of 64, all
    sent (14 bits an element); plus each tensor's 5-entry fp32 table."""
    shapes = model_shapes("llama-70b")
    params = sum(math.prod(s) for s in shapes.values())
    d = DECODERS["llama-70b"]
    assert params == 2 * d.vocab * d.hidden + d.layers * (2 * d.hidden ** 2 + 2 * 1024 * d.hidden
                                                           + 3 * d.hidden * d.intermediate + 2 * d.hidden) + d.hidden
    assert params == 70_553_706_496 and len(shapes) == 1 + 9 * 80 + 2
    w, cl = sim.Workload("llama-70b", 9800.0, 192, 2048), sim.Cluster(20, 1, 1e8, 1e10, 0.0, 0.0)
    p = sim.predict("none", w, cl, sync="sparseloco")
    vectors = [s for s in shapes.values() if len(s) == 1]
    assert len(vectors) == 2 * 80 + 1
    matrices = params - sum(s[0] for s in vectors)
    assert p.bytes_per_sync == matrices // 4096 * 112 + len(vectors) * 8192 * 14 // 8 + 20 * len(shapes)
    assert p.params == params and 146 < p.compression_ratio < 146.3  # 32 / 0.21875 = 146.3 without the tables
