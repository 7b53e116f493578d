"""The auto policy's link probe (gradzip.auto.measure.probe_link) against a link with a known
latency and bandwidth: it recovers them, and on a slow link it stops at the first size that
measures well instead of sending 8 MiB."""

from __future__ import annotations

import time
from dataclasses import astuple

import pytest
import torch

from gradzip.auto.measure import LinkProbe, probe_link


class Link:
    """Two ranks on a ring whose allreduce of B bytes takes 2α + B·8/β (each rank sends B);
    the other rank is this one's twin, so a mean over ranks is the value itself."""

    def __init__(self, alpha: float, bandwidth: float) -> None:
        self.alpha, self.bandwidth, self.sizes = alpha, bandwidth, []

    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        if t.dtype == torch.float32:  # the probe's payloads (the agreement is float64)
            self.sizes.append(nbytes)
            time.sleep(2 * self.alpha + nbytes * 8 / self.bandwidth)
        return t


@pytest.mark.parametrize(("bandwidth", "largest"), [(100e6, 1 << 20), (10e9, 8 << 20)])
def test_probe_recovers_the_link_and_stops_early_on_a_slow_one(bandwidth, largest):
    link = Link(200e-6, bandwidth)
    alpha, bw, noise = astuple(probe_link(link, 2))
    assert max(link.sizes) == largest and len(link.sizes) == 3 * (2 if largest == 1 << 20 else 3)
    assert bw == pytest.approx(bandwidth, rel=0.25)  # sleep overshoots by ~0.1 ms per call
    assert 0 <= alpha < 2e-3 and noise >= 0


def test_one_rank_has_no_link():
    assert probe_link(Link(0, 1), 1) == LinkProbe(0.0, float("inf"), 0.0)


def test_codecs_of_a_model_with_nothing_to_compress_cost_nothing():
    from gradzip.auto.measure import time_codecs

    costs = time_codecs(["none", "fp16", "topk:ratio=0.1,ef=true"], [])
    assert set(costs) == {"none", "fp16", "topk:ratio=0.1,ef=true"} and all(c.encode_s == 0 for c in costs.values())


def test_a_failed_probe_names_the_group_and_keeps_the_error_type():
    from gradzip.errors import CommTimeout

    class Dead(Link):
        def allreduce(self, t, op="sum"):
            raise CommTimeout("allreduce timed out after 5 s on rank 0 waiting for rank 1")

    with pytest.raises(CommTimeout, match=r"auto's link probe over the node leaders \(between nodes\): allreduce "
                                          r"timed out .* rank 1"):
        probe_link(Dead(0, 1), 2, group="the node leaders (between nodes)")
