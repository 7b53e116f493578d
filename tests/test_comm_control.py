"""The control channel (``Communicator.control()``): small bookkeeping collectives that never queue
behind an exchange in flight. Each real-backend test is one launch of
``gradzip.testing.control_probe`` on 2 ranks: rank 0's large allreduce and allgather stay in flight
until its peer has completed two control allreduces, so they complete only on a channel of their
own (else the launch fails by its timeout). The same protocol on the communicator itself must fail,
which shows that the check can."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import mpi_unavailable

from gradzip.comm import spawn_local
from gradzip.comm.sim import SimWorld

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]
needs_mpi = pytest.mark.skipif(mpi_unavailable() is not None, reason=str(mpi_unavailable()))


def _probe(backend: str, out: Path, *extra: str) -> tuple[int, dict[int, dict]]:
    rc = spawn_local(backend, 2, ["--backend", backend, "--out", str(out), "--timeout", "4", *extra],
                     env_extra={"OMP_NUM_THREADS": "1"}, timeout=90, module="gradzip.testing.control_probe",
                     grace=8.0)
    return rc, {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(2)
                if (out / f"rank{r}.json").exists()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["gloo", pytest.param("mpi", marks=needs_mpi)])
def test_control_allreduce_completes_while_the_exchange_waits_for_it(tmp_path, backend):
    rc, reports = _probe(backend, tmp_path)
    assert rc == 0 and sorted(reports) == [0, 1], reports
    for r, rep in reports.items():
        assert rep["first"] == [2.0, 1.0] and rep["second"] == [1.0], (r, rep)  # rank 0 saw its exchange in flight
        assert rep["reduced_exact"] and rep["gathered_exact"], (r, rep)
        # the control channel records into the same stats: 1 large + 2 control allreduces, 1 allgather
        assert rep["calls"] == {"allgather": 1, "allreduce": 3}, (r, rep)


@pytest.mark.timeout(120)
def test_the_probe_fails_on_a_shared_channel(tmp_path):
    rc, reports = _probe("gloo", tmp_path, "--same-channel")
    assert rc != 0
    assert reports and all("error" in rep for rep in reports.values()), reports


def test_sim_is_its_own_control_channel():
    world = SimWorld(2)
    assert all(world[r].control() is world[r] for r in range(2))
    ts = [torch.tensor([1.0, float(r)]) for r in range(2)]
    for h in [world[r].control().allreduce_async(ts[r], "sum") for r in range(2)]:
        h.wait()
    assert all(t.tolist() == [2.0, 1.0] for t in ts)
