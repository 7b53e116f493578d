"""The backend self-test: the battery of :mod:`gradzip.testing.comm_battery`, checked.

Run it as N ranks under any launcher, e.g.::

    torchrun --nproc-per-node 4 -m gradzip.testing.comm_selftest --backend gloo --check
    mpirun -n 4 python -m mpi4py -m gradzip.testing.comm_selftest --backend mpi --check

``--check`` runs :func:`self_check` and recomputes every rank's expected results with an
in-process ``SimWorld`` (the inputs are a function of rank and world size), and prints PASS/FAIL
per rank. ``--out DIR`` saves each rank's results (``rank{r}.pt``) and any failure-phase report
(``rank{r}.json``); the tests use it. :func:`self_check` verifies the alltoall, split and
same-shape results against values computed directly from the rank-dependent inputs,
independently of ``sim``; :func:`compare` compares a rank's results with the ``sim`` reference.

The optional failure phase (``--fail``) runs after the battery, with ``--fail-timeout`` seconds:
``die:R`` — rank R exits with code 1 before an allreduce; ``stall:R`` — rank R stops its
heartbeat / ping answers and sleeps (a hung rank); ``behind:R`` — rank R stays responsive but
sleeps instead of joining. The other ranks record the CommError they get, then exit with code 3.
With ``--fail-on split`` the allreduce runs on a reversed all-ranks split instead of the world
(the error must then name global ranks); ``--fail-op`` makes the failing collective a
variable-size (``allgather``) or a ``same_shape`` allgather (``allgather_same``) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

import torch
from torch import Tensor

from gradzip.comm.base import Communicator
from gradzip.comm.launch import init_communicator
from gradzip.comm.sim import SimWorld
from gradzip.errors import CommError
from gradzip.testing.comm_battery import (
    ALLTOALL_CASES,
    SAME_SHAPE_CASES,
    alltoall_input,
    expected_alltoall,
    run_battery,
    same_shape_input,
    split_members,
)

FLOAT_TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12),
             torch.float16: (5e-3, 1e-2), torch.bfloat16: (2e-2, 1e-1)}


def self_check(got: dict[str, Tensor], rank: int, n: int) -> list[str]:
    """Checks of the alltoall and split results against values computed directly from the inputs
    (not through ``sim``): what ``rank`` of ``n`` must have received."""
    from gradzip.comm import cost  # the accounting formulas every backend shares

    problems: list[str] = []

    def want(key: str, value: Tensor) -> None:
        if key not in got:
            problems.append(f"{key}: missing")
        elif got[key].dtype != value.dtype or got[key].shape != value.shape or not torch.equal(got[key], value):
            problems.append(f"{key}: got {got[key].dtype}{tuple(got[key].shape)} {got[key].flatten()[:8].tolist()}, "
                            f"want {value.dtype}{tuple(value.shape)} {value.flatten()[:8].tolist()}")

    for name, (dt, shape) in ALLTOALL_CASES.items():
        want(f"alltoall/{name}", expected_alltoall([alltoall_input(dt, shape(n), i) for i in range(n)], rank))
    bases = [(torch.arange(4 * 2 * n, dtype=torch.float32).reshape(4, 2 * n) * (i + 1)).t() for i in range(n)]
    want("alltoall/noncontiguous", expected_alltoall(bases, rank))
    want("alltoall/async", expected_alltoall([alltoall_input(torch.uint8, (n, 9), i, 1) for i in range(n)], rank))
    want("alltoall/async_ar", torch.full((64,), float(sum(range(n)))))
    want("alltoall/bad_input", torch.tensor([True, True]))
    for name, (dt, shape) in SAME_SHAPE_CASES.items():
        for k in range(n):
            want(f"same/{name}/{k}", same_shape_input(dt, shape, k))
    for k in range(n):
        want(f"same/noncontiguous/{k}", torch.arange(24, dtype=torch.float64).reshape(4, 6)[:, ::2] * (k + 1))
    rev_members = split_members(n, lambda i: 0, lambda i: n - i)[0]
    for prefix, members in (("launch/world", list(range(n))), ("launch/split", rev_members)) if n > 1 else ():
        want(f"{prefix}/same_calls", torch.tensor([1, 0], dtype=torch.int64))  # one collective, no header
        want(f"{prefix}/same_result", torch.stack([same_shape_input(torch.float32, (4, 3), i) for i in members]))
        want(f"{prefix}/var_calls_ok", torch.tensor(True))
        for k, i in enumerate(members):
            want(f"{prefix}/var_result/{k}", torch.arange(i + 2, dtype=torch.int16))
    want("launch/nonblocking", torch.tensor(True))
    want("launch/nonblocking_result", torch.cat(
        [torch.cat([torch.full((3,), float(i)) for i in range(n)]), torch.cat([torch.full((i + 1,), float(i))
                                                                              for i in range(n)]),
         torch.cat([torch.ones(2 * i * 2) for i in range(n)])]))
    for name in ("same", "other"):
        want(f"launch/wait_order/{name}", torch.cat([torch.full((4,), sum(i + 1 for i in range(n)), dtype=torch.int64),
                                                     *[torch.arange(i + 2, dtype=torch.int64) * 3 for i in range(n)]]))
    mix = [lambda i: torch.full((i + 1, 2), i, dtype=torch.uint8), lambda i: torch.full((2, 2), float(i)).half(),
           lambda i: torch.full((2 * i + 1,), i, dtype=torch.int32), None, lambda i: torch.full((i,), i == 1),
           lambda i: torch.full((5,), i, dtype=torch.int64)]
    for j, make in enumerate(mix):
        if make is None:
            want(f"launch/mix/{j}/0", torch.full((8,), float(sum(range(n)))))
        else:
            for k in range(n):
                want(f"launch/mix/{j}/{k}", make(k))
    want("split/shared_stats", torch.tensor(True))
    groups = [(split_members(n, lambda i: i % 2, lambda i: -i)[rank % 2], 2, "split")]
    groups.append((list(reversed(groups[0][0])), 3, "split/split"))
    groups.append((split_members(n, lambda i: 0, lambda i: n - i)[0], 4, "split/all"))
    calls = sent = recv = 0
    for members, tag, prefix in groups:
        m, me = len(members), members.index(rank)
        want(f"{prefix}/rank", torch.tensor([me, m], dtype=torch.int64))
        want(f"{prefix}/allreduce", torch.full((5,), float(sum(i + 1 for i in members))))
        for k, i in enumerate(members):
            want(f"{prefix}/allgather/{k}", torch.arange(i + 1, dtype=torch.int32) + 100 * i)
            want(f"{prefix}/allgather_same/{k}", torch.full((3, 2), i + 0.5).bfloat16())
        want(f"{prefix}/broadcast", torch.full((7,), float(members[0])).bfloat16())
        ins = [alltoall_input(torch.int64, (2 * m, 3), i, tag) for i in members]
        want(f"{prefix}/alltoall", expected_alltoall(ins, me))
        # the parent's stats grew by the sub-communicator's traffic (and the split itself)
        ps = len(groups[0][0]) if prefix == "split/split" else n  # the world size of the split's parent
        prev = groups[0][0].index(rank) if prefix == "split/split" else rank
        s_sent, s_recv = cost.allgather_bytes([16] * ps, prev)
        ar = cost.allreduce_bytes(5 * 4, m)
        ag_sent, ag_recv = cost.allgather_bytes([4 * (i + 1) for i in members], me)
        same_sent, same_recv = cost.allgather_bytes([3 * 2 * 2] * m, me)  # equal sizes, as a variable one
        bc_sent, bc_recv = cost.broadcast_bytes(7 * 2, m, me, 0)
        a2a = cost.alltoall_bytes(2 * m * 3 * 8, m)
        calls += 7
        sent += s_sent + ar + ag_sent + same_sent + bc_sent + a2a
        recv += s_recv + ar + ag_recv + same_recv + bc_recv + a2a
    want("split/stats_delta", torch.tensor([calls, sent, recv], dtype=torch.int64))
    return problems


def sim_reference(n: int) -> list[dict[str, Tensor]]:
    """The battery on an n-worker threaded ``SimWorld``: the expected results of every rank."""
    world = SimWorld(n, threaded=True, timeout=60)
    res: list[Any] = [None] * n

    def work(rank: int) -> None:
        try:
            res[rank] = run_battery(world[rank])
        except BaseException as e:  # reported below
            res[rank] = e

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for x in res:
        if isinstance(x, BaseException):
            raise x
    return res


def compare(got: dict[str, Tensor], want: dict[str, Tensor]) -> list[str]:
    """Differences between a rank's results and the reference (empty: equal). Floats to the
    tolerance of their dtype (reduction order and fp16/bf16 accumulation differ); the rest exactly."""
    problems = []
    if set(got) != set(want):
        problems.append(f"keys differ: missing {sorted(set(want) - set(got))}, extra {sorted(set(got) - set(want))}")
    for key in sorted(set(got) & set(want)):
        a, b = got[key], want[key]
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{key}: got {a.dtype}{tuple(a.shape)}, want {b.dtype}{tuple(b.shape)}")
            continue
        reduced = key.startswith(("allreduce/", "overlap/a", "overlap/c"))
        if a.dtype in FLOAT_TOL and reduced:
            rtol, atol = FLOAT_TOL[a.dtype]
            ok = torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol)
        else:
            ok = torch.equal(a, b)
        if not ok:
            problems.append(f"{key}: values differ (max |diff| "
                            f"{(a.double() - b.double()).abs().max().item() if a.numel() else 0:g})")
    return problems


def _failure_phase(comm: Communicator, spec: str, fail_timeout: float, on: str = "world",
                   op: str = "allreduce") -> dict[str, Any] | None:
    """``on="split"``: the failing collective runs on ``comm.split(0, key=-rank)`` (every rank,
    in reverse order), after one barrier there, so that the diagnosis must name global ranks.
    ``op``: ``allreduce``, ``allgather`` (variable size) or ``allgather_same`` (``same_shape=True``)."""
    roles = dict(item.split(":") for item in spec.split(","))
    me = {kind for kind, who in roles.items() if int(who) == comm.rank}
    comm.barrier()
    comms = [comm]
    if on == "split":
        comms.append(comm.split(0, key=-comm.rank))
        comms[-1].barrier()
    for c in comms:
        c.timeout = fail_timeout
    if "die" in me:
        sys.stdout.flush()
        os._exit(1)
    if "stall" in me:
        for c in comms:
            if getattr(c, "_hb", None) is not None:
                c._hb.pause()  # torch: heartbeat stops
            c._responding = False  # mpi: no answers to pings
    if me:  # stall / behind: do not join; sleep until killed
        time.sleep(fail_timeout + 60)
        os._exit(0)
    t0 = time.monotonic()
    try:
        if op == "allreduce":
            comms[-1].allreduce(torch.ones(1 << 12), "sum")
        else:
            comms[-1].allgather(torch.ones((1 << 12) + (op == "allgather") * comm.rank), same_shape=op != "allgather")
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0,
                "is_comm_error": isinstance(e, CommError)}
    return {"error": None, "seconds": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gradzip.testing.comm_selftest", description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl", "torch", "mpi"])
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--out", default=None, help="directory for rank{r}.pt / rank{r}.json")
    p.add_argument("--check", action="store_true", help="compare with an in-process sim reference")
    p.add_argument("--fail", default=None, help="failure phase, e.g. die:2 or stall:2,behind:3")
    p.add_argument("--fail-timeout", type=float, default=5.0)
    p.add_argument("--fail-on", default="world", choices=["world", "split"],
                   help="run the failing collective on the world or on a reversed split of it")
    p.add_argument("--fail-op", default="allreduce", choices=["allreduce", "allgather", "allgather_same"],
                   help="the failing collective (allgather: variable size; allgather_same: same_shape=True)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    comm = init_communicator(args.backend, timeout=args.timeout)
    results = run_battery(comm)
    status = 0
    if args.check:
        problems = self_check(results, comm.rank, comm.world_size)
        problems += compare(results, sim_reference(comm.world_size)[comm.rank])
        print(f"rank {comm.rank}/{comm.world_size} {comm.backend}: "
              + ("PASS" if not problems else "FAIL\n  " + "\n  ".join(problems)), flush=True)
        status = 1 if problems else 0
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tmp = os.path.join(args.out, f".rank{comm.rank}.pt.tmp")
        torch.save(results, tmp)
        os.replace(tmp, os.path.join(args.out, f"rank{comm.rank}.pt"))
    if args.fail:
        report = _failure_phase(comm, args.fail, args.fail_timeout, args.fail_on, args.fail_op)
        if args.out and report is not None:
            with open(os.path.join(args.out, f"rank{comm.rank}.json"), "w") as f:
                json.dump(report, f)
        comm.close()  # after a failure: no teardown of the broken group (see the backends' close())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    comm.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
