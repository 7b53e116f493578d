"""A battery of collectives for checking a backend against ``sim`` (the reference).

Run it as N ranks under any launcher, e.g.::

    torchrun --nproc-per-node 4 -m gradzip.comm._selftest --backend gloo --check
    mpirun -n 4 python -m mpi4py -m gradzip.comm._selftest --backend mpi --check

``--check`` recomputes every rank's expected results with an in-process ``SimWorld`` (the inputs
are a function of rank and world size) and prints PASS/FAIL per rank. ``--out DIR`` saves each
rank's results (``rank{r}.pt``) and any failure-phase report (``rank{r}.json``); the tests use it.

The optional failure phase (``--fail``) runs after the battery, with ``--fail-timeout`` seconds:
``die:R`` — rank R exits with code 1 before an allreduce; ``stall:R`` — rank R stops its
heartbeat / ping answers and sleeps (a hung rank); ``behind:R`` — rank R stays responsive but
sleeps instead of joining. The other ranks record the CommError they get, then exit with code 3.
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

FLOAT_TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12),
             torch.float16: (5e-3, 1e-2), torch.bfloat16: (2e-2, 1e-1)}
ALLREDUCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
                    torch.uint8, torch.bool)


def _make(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.3
    if dtype == torch.uint8:
        return torch.randint(0, 60, shape, generator=g, dtype=torch.uint8)  # 4 ranks: no overflow
    return torch.randint(-50, 50, shape, generator=g, dtype=dtype)


def run_battery(comm: Communicator) -> dict[str, Tensor]:
    """Every collective of the contract; returns named results (same on all backends)."""
    r, n = comm.rank, comm.world_size
    g = torch.Generator().manual_seed(1000 + r)
    out: dict[str, Tensor] = {}
    for dt in ALLREDUCE_DTYPES:
        for op in ("sum", "mean"):
            for numel in (1003, 1, 0):
                t = _make(dt, (numel,), g)
                out[f"allreduce/{dt}/{op}/{numel}"] = comm.allreduce(t, op)
    base = torch.randn(8, 6, generator=g)
    comm.allreduce(base.t(), "mean")  # non-contiguous view: the base is updated in place
    out["allreduce/noncontiguous"] = base
    cases: dict[str, Tensor] = {
        "f32": torch.randn(r + 1, 3, generator=g),
        "u8": torch.randint(0, 256, (5 * r,), generator=g, dtype=torch.uint8),  # rank 0: empty
        "i32": torch.arange(7 + r, dtype=torch.int32) * (r + 1),
        "bf16": torch.randn(2, r + 2, generator=g).bfloat16(),
        "scalar": torch.tensor(float(r)),
        "empty": torch.empty(0, 4),
        "bool": torch.rand(r + 3, generator=g) > 0.5,
        "f16_3d": torch.randn(r % 2 + 1, 2, 3, generator=g).half(),
    }
    for name, t in cases.items():
        for k, x in enumerate(comm.allgather(t)):
            out[f"allgather/{name}/{k}"] = x
    t = torch.randn(33, generator=g) + r
    out["broadcast/f32"] = comm.broadcast(t, src=n - 1)
    out["broadcast/u8"] = comm.broadcast(torch.randint(0, 256, (17,), generator=g, dtype=torch.uint8), src=0)
    out["broadcast/bf16"] = comm.broadcast(torch.randn(5, 3, generator=g).bfloat16(), src=1 % n)
    # Several outstanding operations at once, waited on in reverse order.
    a = torch.randn(1 << 16, generator=g)
    b = torch.randint(0, 256, (1000 + 10 * r,), generator=g, dtype=torch.uint8)
    c = torch.randn(100, generator=g).half()
    d = torch.randn(9, generator=g)
    handles = [comm.allreduce_async(a, "mean"), comm.allgather_async(b), comm.broadcast_async(d, src=0),
               comm.allreduce_async(c, "sum")]
    results = [h.wait() for h in reversed(handles)][::-1]
    out["overlap/a"], out["overlap/d"], out["overlap/c"] = results[0], results[2], results[3]
    for k, x in enumerate(results[1]):
        out[f"overlap/b/{k}"] = x
    comm.barrier()
    for op, tot in sorted(comm.stats.by_op.items()):
        out[f"stats/{op}"] = torch.tensor([tot.calls, tot.bytes_sent, tot.bytes_recv], dtype=torch.int64)
    return out


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


def _failure_phase(comm: Communicator, spec: str, fail_timeout: float) -> dict[str, Any] | None:
    roles = dict(item.split(":") for item in spec.split(","))
    me = {kind for kind, who in roles.items() if int(who) == comm.rank}
    comm.barrier()
    comm.timeout = fail_timeout
    if "die" in me:
        sys.stdout.flush()
        os._exit(1)
    if "stall" in me:
        if getattr(comm, "_hb", None) is not None:
            comm._hb.pause()  # torch: heartbeat stops
        comm._responding = False  # mpi: no answers to pings
    if me:  # stall / behind: do not join; sleep until killed
        time.sleep(fail_timeout + 60)
        os._exit(0)
    t0 = time.monotonic()
    try:
        comm.allreduce(torch.ones(1 << 12), "sum")
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0,
                "is_comm_error": isinstance(e, CommError)}
    return {"error": None, "seconds": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gradzip.comm._selftest", description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl", "torch", "mpi"])
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--out", default=None, help="directory for rank{r}.pt / rank{r}.json")
    p.add_argument("--check", action="store_true", help="compare with an in-process sim reference")
    p.add_argument("--fail", default=None, help="failure phase, e.g. die:2 or stall:2,behind:3")
    p.add_argument("--fail-timeout", type=float, default=5.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    comm = init_communicator(args.backend, timeout=args.timeout)
    results = run_battery(comm)
    status = 0
    if args.check:
        problems = compare(results, sim_reference(comm.world_size)[comm.rank])
        print(f"rank {comm.rank}/{comm.world_size} {comm.backend}: "
              + ("PASS" if not problems else "FAIL\n  " + "\n  ".join(problems)), flush=True)
        status = 1 if problems else 0
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tmp = os.path.join(args.out, f".rank{comm.rank}.pt.tmp")
        torch.save(results, tmp)
        os.replace(tmp, os.path.join(args.out, f"rank{comm.rank}.pt"))
    if args.fail:
        report = _failure_phase(comm, args.fail, args.fail_timeout)
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
