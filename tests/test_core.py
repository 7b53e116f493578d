"""Units, cost-model formulas, spec parsing and the CLI's error contract."""

import warnings

import pytest
import torch

from gradzip.comm import cost
from gradzip.compress import create, parse_spec, registry
from gradzip.errors import SpecError
from gradzip.units import parse_bandwidth, parse_latency, parse_size


@pytest.mark.parametrize("text,bps", [("1gbit", 1e9), ("100mbit", 1e8), ("10Gbit", 1e10), ("2.5gbps", 2.5e9),
                                      ("125MB/s", 1e9), (1e6, 1e6),
                                      ("100Mb/s", 1e8), ("100MB/s", 8e8), ("1Gbps", 1e9), ("1GBps", 8e9)])
def test_bandwidth(text, bps):
    assert parse_bandwidth(text) == pytest.approx(bps)


@pytest.mark.parametrize("text,s", [("50us", 5e-5), ("0.1ms", 1e-4), ("2s", 2.0), ("0", 0.0), ("10ns", 1e-8)])
def test_latency(text, s):
    assert parse_latency(text) == pytest.approx(s)


def test_size():
    assert parse_size("25MB") == 25_000_000
    assert parse_size("1MiB") == 2**20


@pytest.mark.parametrize("bad", ["-1gbit", "fast", "10 furlongs", "0gbit"])
def test_bad_bandwidth(bad):
    with pytest.raises(SpecError):
        parse_bandwidth(bad)


def test_ring_allreduce_hand_computed():
    # 4 ranks, 1 MB buffer: each rank sends 2*3/4 MB = 1.5 MB; at 1 Gbit/s = 12 ms, plus 6 latencies.
    link = cost.Link(1e9, 1e-5)
    assert cost.allreduce_bytes(1_000_000, 4) == 1_500_000
    assert cost.allreduce_time(1_000_000, 4, link) == pytest.approx(6e-5 + 1.5e6 * 8 / 1e9)
    assert cost.allreduce_bytes(1_000_000, 1) == 0 and cost.allreduce_time(1e6, 1, link) == 0.0


def test_allgather_hand_computed():
    sizes = [10, 20, 30, 40]
    # rank 1 forwards every block except rank 2's: 100 - 30; receives all but its own: 100 - 20
    assert cost.allgather_bytes(sizes, 1) == (70, 80)
    assert cost.allgather_bytes([5, 5, 5], 0) == (10, 10)  # (n-1)·s
    link = cost.Link(8.0, 0.5)  # 1 byte/s
    assert cost.allgather_time([5, 5, 5], link) == pytest.approx(2 * 0.5 + 10)


def test_broadcast_chain():
    assert [cost.broadcast_bytes(100, 3, r, src=1) for r in range(3)] == [(0, 100), (100, 0), (100, 100)]


def test_hierarchical_equals_ring_with_one_gpu_per_node():
    inter, intra = cost.Link(1e10, 1e-5), cost.Link(1e11, 1e-6)
    for nodes in (1, 2, 8):
        assert cost.hierarchical_allreduce_time(4e8, nodes, 1, inter, intra) == pytest.approx(
            cost.allreduce_time(4e8, nodes, inter))


def test_parse_spec():
    assert parse_spec(" TopK : ratio=0.01 , ef=true") == ("topk", {"ratio": "0.01", "ef": "true"})
    with pytest.raises(SpecError, match="key=value"):
        parse_spec("topk:ratio")
    with pytest.raises(SpecError, match="twice"):
        parse_spec("topk:ratio=1,ratio=2")


def test_unknown_compressor_lists_choices():
    with pytest.raises(SpecError) as e:
        create("zip9000")
    for name in registry():
        assert name in str(e.value)


def test_ef_spec_roundtrip():
    c = create("none:ef=true")
    assert c.spec == "none:ef=true"
    assert create(c.spec).spec == c.spec
    x = torch.randn(11)
    p, ctx = c.compress(x, "k")
    assert torch.equal(c.decompress(p, ctx), x)


def test_cli_bad_input_is_one_line_exit_2(capsys):
    from gradzip.cli import main

    with pytest.raises(SystemExit) as e:
        main(["no-such-command"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "invalid choice" in err


@pytest.mark.parametrize("spec, caveat", [("qsgd:ef=true", "no contraction"), ("terngrad:ef=true", "no contraction"),
                                          ("randomk:ef=true", "not a contraction"), ("demo:ef=true", "is ignored")])
def test_error_feedback_caveats_warn_once(spec, caveat, monkeypatch):
    """Error feedback where it cannot help warns, once per process (specs are parsed per worker)."""
    import sys

    reg = sys.modules["gradzip.compress.registry"]  # gradzip.compress.registry is also a function's name
    monkeypatch.setattr(reg, "_WARNED", set())
    with pytest.warns(UserWarning, match=caveat):
        reg.create(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg.create(spec)  # the second time: silent
