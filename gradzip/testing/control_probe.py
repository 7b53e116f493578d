"""The control channel under exchanges in flight: a check for N ranks of a real backend.

Run it under any launcher, e.g.::

    torchrun --nproc-per-node 2 -m gradzip.testing.control_probe --backend gloo --out DIR
    mpirun -n 2 python -m mpi4py -m gradzip.testing.control_probe --backend mpi --out DIR

Rank 0 launches a large allreduce and a large ``same_shape`` allgather on the communicator, then
two small allreduces on its control channel (:meth:`gradzip.comm.base.Communicator.control`); the
other ranks post their side of the two large collectives only after both control allreduces have
completed. So the control allreduces can only complete if they do not queue behind (or match
with) the data collectives in flight: otherwise rank 0 waits for a peer that waits for rank 0,
until the timeout (``--timeout``), and the check fails with a CommError. The second control
allreduce carries rank 0's observation that its large allreduce was still in flight when the first
one had completed. ``--same-channel`` runs the same protocol with the communicator itself in place
of its control channel (it must fail: the tests use it to show that the check can).

Each rank writes ``rank{r}.json``: the control sums, whether the large results are exact, the
flag, the communicator's counted calls by op, or the error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from gradzip.comm.base import Communicator
from gradzip.comm.launch import init_communicator
from gradzip.errors import CommError

BIG = 1 << 20  # elements of each large collective (4 MiB of fp32)


def run(comm: Communicator, same_channel: bool = False) -> dict[str, Any]:
    """The protocol of the module docstring on this rank; returns what it saw."""
    ctl = comm if same_channel else comm.control()
    n, r = comm.world_size, comm.rank
    big = torch.full((BIG,), float(r + 1))
    mine = torch.arange(BIG, dtype=torch.float32) + r
    small = torch.tensor([1.0, float(r)], dtype=torch.float64)
    out: dict[str, Any] = {}
    if r == 0:
        handles = (comm.allreduce_async(big, "sum"), comm.allgather_async(mine, same_shape=True))
        out["first"] = ctl.allreduce(small, "sum").tolist()
        in_flight = not handles[0].is_completed()
        out["second"] = ctl.allreduce(torch.tensor([float(in_flight)], dtype=torch.float64), "sum").tolist()
        reduced, gathered = handles[0].wait(), handles[1].wait()
    else:
        out["first"] = ctl.allreduce(small, "sum").tolist()
        out["second"] = ctl.allreduce(torch.zeros(1, dtype=torch.float64), "sum").tolist()
        handles = (comm.allreduce_async(big, "sum"), comm.allgather_async(mine, same_shape=True))
        reduced, gathered = handles[0].wait(), handles[1].wait()
    out["reduced_exact"] = bool(torch.equal(reduced, torch.full((BIG,), float(n * (n + 1) // 2))))
    out["gathered_exact"] = all(torch.equal(g, torch.arange(BIG, dtype=torch.float32) + k)
                                for k, g in enumerate(gathered))
    out["calls"] = {op: t.calls for op, t in sorted(comm.stats.by_op.items())}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gradzip.testing.control_probe", description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--out", required=True, help="directory for rank{r}.json")
    ap.add_argument("--timeout", type=float, default=10.0, help="collective timeout in seconds")
    ap.add_argument("--same-channel", action="store_true", help="use the communicator itself (must fail)")
    args = ap.parse_args(argv)
    comm = init_communicator(args.backend, timeout=args.timeout)
    path = Path(args.out) / f"rank{comm.rank}.json"
    try:
        report = run(comm, args.same_channel)
        code = 0
    except CommError as e:
        report, code = {"error": str(e)}, 3
    path.write_text(json.dumps(report))
    if code == 0:
        comm.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
