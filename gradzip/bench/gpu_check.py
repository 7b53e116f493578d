"""``python -m gradzip.bench.gpu_check``: the GPU paths in one prepared run (a few minutes on one GPU).

Checks, each reported as ok, FAILED or skipped (with the reason), printed as a table and written
to ``--out`` (JSON):

1. ``collectives-1`` and ``collectives-N``: gradzip's torch Communicator on NCCL, at world size 1
   and with N processes sharing the one GPU (``--ranks``, default 2): allreduce, allgather of
   variable and of equal sizes, broadcast and alltoall on CUDA tensors, against values computed
   directly. (NCCL may refuse two ranks on one device; the check then reports NCCL's error.)
2. ``compressors``: every registered compressor, bare and with error feedback, on a bucket of CUDA
   tensors against its CPU result: the same payload bytes; deterministic compressors (those whose
   CPU result does not change with the torch seed) the same output to 1e-4 of its scale; the
   stochastic ones a round-trip error within 2× of the CPU's.
   ``host-syncs`` (CUDA only): every compressor that declares no host sync (``host_syncs``), bare
   and with error feedback, runs its round trip under CUDA's sync debug mode without a warning.
3. ``train-fp16``: ``gradzip train --device cuda --precision fp16`` (autocast + GradScaler) on 2 sim
   workers with a NaN injected at step 4 (``GRADZIP_FAULT``): the step is skipped on every worker,
   the run finishes and its loss is finite; ``train-nccl``: the same on ``--backend nccl`` with
   one rank.
4. ``bench``: ``gradzip bench compress --device cuda``, each compressor's time against a memcpy.

``--device cpu`` runs the same checks on the CPU (gloo for NCCL, bf16 for fp16) to test this
script where there is no GPU; the test suite does so. Record a GPU run's output in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

CHECKS = ("collectives", "compressors", "train", "bench")
SHAPES = [(256, 512), (4096,), (33,)]  # one bucket: a matrix, a vector, a small odd tensor


def _collectives_worker(out: str) -> None:
    """One rank of the collectives check (started by :func:`check_collectives`)."""
    from gradzip.comm.launch import init_communicator
    backend = os.environ["GZ_CHECK_BACKEND"]
    comm = init_communicator(backend, timeout=60)
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    r, n = comm.rank, comm.world_size
    res: dict[str, Any] = {"device": str(dev)}
    s = comm.allreduce(torch.full((1000,), float(r + 1), device=dev))
    res["allreduce"] = bool((s == n * (n + 1) / 2).all())
    parts = comm.allgather(torch.arange(r + 1, dtype=torch.float32, device=dev) + r)
    res["allgather"] = all(torch.equal(p.cpu(), torch.arange(i + 1, dtype=torch.float32) + i)
                           for i, p in enumerate(parts))
    same = comm.allgather(torch.full((5,), r, dtype=torch.int64, device=dev), same_shape=True)
    res["allgather_same_shape"] = all(bool((p.cpu() == i).all()) for i, p in enumerate(same))
    res["broadcast"] = bool((comm.broadcast(torch.full((3,), float(r), device=dev), src=0) == 0).all())
    a2a = comm.alltoall(torch.arange(2 * n, dtype=torch.float32, device=dev).view(n, 2) + 100 * r)
    want = torch.stack([torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + 100 * i for i in range(n)])
    res["alltoall"] = torch.equal(a2a.cpu(), want)
    comm.barrier()
    comm.close()
    Path(out, f"rank{r}.json").write_text(json.dumps(res))


def check_collectives(ranks: int, backend: str, timeout: float = 120.0) -> dict[str, Any]:
    from gradzip.comm.launch import free_port
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GZ_CHECK_BACKEND": backend, "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(ranks)}
        procs = [subprocess.Popen([sys.executable, "-m", "gradzip.bench.gpu_check", "--worker", tmp],
                                  env={**env, "RANK": str(r), "LOCAL_RANK": "0"}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(ranks)]
        outs, deadline = [], time.monotonic() + timeout
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                return {"ok": False, "detail": f"timed out after {timeout:g} s"}
        got = [Path(tmp, f"rank{r}.json") for r in range(ranks)]
        if not all(g.exists() for g in got):
            return {"ok": False, "detail": " | ".join(o.strip().splitlines()[-1] for o in outs if o.strip())}
        res = [json.loads(g.read_text()) for g in got]
    bad = sorted({k for r in res for k, v in r.items() if v is False})
    return {"ok": not bad, "detail": f"{ranks} rank(s) on {res[0]['device']}" + (f"; wrong: {bad}" if bad else "")}


def _device_round_trip(c: Any, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """One rank's exchange of one bucket, on the tensors' device: outputs and payload bytes."""
    payload, ctx = c.compress_batch(tensors, "b")
    sent = sum(p.numel() * p.element_size() for p in payload)
    for _ in range(1, c.rounds):
        payload, ctx = c.next_round_batch(tuple(p.clone() for p in payload), ctx)
        sent += sum(p.numel() * p.element_size() for p in payload)
    return c.decompress_batch(tuple(p.clone() for p in payload), ctx), sent


def _round_trip(c: Any, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    out, sent = _device_round_trip(c, tensors)
    return [t.float().cpu() for t in out], sent


def check_host_syncs(device: torch.device, compressors: Any = None,
                     set_mode: Any = None) -> dict[str, Any]:
    """Every compressor that declares no host sync (``host_syncs == ""``), bare and with EF: one
    round trip to warm up (lazy initialisation may sync once), then one under CUDA's sync debug
    mode, counting the synchronizing calls it warns of. ``compressors`` and ``set_mode`` default
    to the registry's and ``torch.cuda.set_sync_debug_mode`` (tests pass their own)."""
    set_mode = set_mode or torch.cuda.set_sync_debug_mode
    if compressors is None:
        compressors = _declared_sync_free()
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen).to(device) for s in SHAPES]
    syncs: dict[str, Any] = {}
    for c in compressors:
        try:
            _device_round_trip(c, [g.clone() for g in grads])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                set_mode("warn")
                try:
                    _device_round_trip(c, [g.clone() for g in grads])
                finally:
                    set_mode("default")
            if n := sum("synchroniz" in str(w.message) for w in caught):
                syncs[c.spec] = n
        except Exception as e:  # noqa: BLE001 - the compressors check reports crashes; note it here too
            syncs[c.spec] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    n = len(compressors)
    return {"ok": not syncs, "syncs": syncs,
            "detail": f"{n - len(syncs)}/{n} specs that declare none queue their exchange without a host sync"
                      + ("; " + "; ".join(f"{k}: {v}" for k, v in syncs.items()) if syncs else "")}


def _declared_sync_free() -> list[Any]:
    from gradzip.compress import create, registry
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # EF on an unbiased compressor warns; here it is on purpose
        for name, cls in registry().items():
            if not cls.host_syncs:
                out += [create(s) for s in dict.fromkeys([name, f"{name}:ef=true"])]
    return out


def check_compressors(device: torch.device) -> dict[str, Any]:
    from gradzip.compress import registry
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    failed, n = [], 0
    with warnings.catch_warnings():
        return _compare_all(registry(), grads, device, failed, n)


def _compare_all(names: Any, grads: list[torch.Tensor], device: torch.device, failed: list[str],
                 n: int) -> dict[str, Any]:
    from gradzip.compress import create
    for name in names:
        for spec in dict.fromkeys([name, f"{name}:ef=true"]):
            n += 1
            try:
                warnings.simplefilter("ignore")  # EF on an unbiased compressor warns; here it is on purpose
                torch.manual_seed(1)
                cpu, cpu_bytes = _round_trip(create(spec), [g.clone() for g in grads])
                torch.manual_seed(2)
                again, _ = _round_trip(create(spec), [g.clone() for g in grads])
                torch.manual_seed(1)
                dev, dev_bytes = _round_trip(create(spec), [g.to(device) for g in grads])
                if dev_bytes != cpu_bytes:
                    failed.append(f"{spec}: {dev_bytes} payload bytes on {device}, {cpu_bytes} on cpu")
                elif all(torch.equal(a, b) for a, b in zip(cpu, again)):  # deterministic
                    for a, b in zip(cpu, dev):
                        if not torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(a.abs().max() or 1)):
                            failed.append(f"{spec}: output differs from cpu by {float((a - b).abs().max()):.3g}")
                            break
                else:
                    err = [sum(float((o - g).norm()) for o, g in zip(out, grads)) for out in (cpu, dev)]
                    if not math.isfinite(err[1]) or err[1] > 2 * err[0] + 1e-6:
                        failed.append(f"{spec}: round-trip error {err[1]:.3g} on {device} vs {err[0]:.3g} on cpu")
            except Exception as e:  # noqa: BLE001 - every compressor is reported, not the first failure
                failed.append(f"{spec}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return {"ok": not failed, "detail": f"{n - len(failed)}/{n} specs agree" + ("; " + "; ".join(failed) if failed
                                                                                else "")}


def check_train(device: str, backend: str, workers: int, corpus: str | None) -> dict[str, Any]:
    precision = "fp16" if device == "cuda" else "bf16"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "gradzip", "train", "--device", device, "--precision", precision,
               "--backend", backend, "--workers", str(workers), "--steps", "8", "--seq-len", "64",
               "--batch-size", "8", "--eval-every", "0", "--eval-batches", "2", "--compressor", "onebit",
               "--timeout", "120", "--out", str(Path(tmp, "run")), "--no-progress"]
        cmd += ["--corpus", corpus] if corpus else []
        p = subprocess.run(cmd, env={**os.environ, "GRADZIP_FAULT": "nan:step=4"}, capture_output=True, text=True,
                           timeout=900)
        if p.returncode != 0:
            return {"ok": False, "detail": (p.stderr or p.stdout).strip().splitlines()[-1][:300]}
        summary = json.loads(Path(tmp, "run", "summary.json").read_text())
        rows = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in rows if r.get("skipped")]
    ok = skipped == [4] and math.isfinite(summary.get("final_loss") or math.nan)
    return {"ok": ok, "detail": f"{precision}, {backend} x{workers}: skipped steps {skipped}, final loss "
                                f"{summary.get('final_loss'):.4f}"}


def check_bench(device: str) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-m", "gradzip", "bench", "compress", "--device", device, "--repeat", "3",
                        "--numel", str(1 << 22), "--json"], capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        return {"ok": False, "detail": (p.stderr or p.stdout).strip().splitlines()[-1][:300]}
    rows = json.loads(p.stdout)
    errors = [r["name"] for r in rows if "error" in r]
    times = ", ".join(f"{r['name']} {r['ratio_to_memcpy']:.1f}x" for r in rows if "ratio_to_memcpy" in r)
    return {"ok": not errors, "detail": (f"errors: {errors}; " if errors else "") + f"x memcpy: {times}",
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gradzip.bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: test this script without a GPU")
    p.add_argument("--ranks", type=int, default=2, help="processes sharing the device in collectives-N")
    p.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated checks: {', '.join(CHECKS)}")
    p.add_argument("--corpus", default=None, help="training corpus for the train checks (default: the built-in one)")
    p.add_argument("--out", default="gpu_check.json", help="where to write the results (JSON)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _collectives_worker(args.worker)
        return 0
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    if unknown := [c for c in only if c not in CHECKS]:
        print(f"gpu_check: unknown check(s) {unknown}; choose from {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine, or --device cpu to test the script",
              file=sys.stderr)
        return 2
    backend = "nccl" if args.device == "cuda" else "gloo"
    plan = {
        "collectives-1": ("collectives", lambda: check_collectives(1, backend)),
        f"collectives-{args.ranks}": ("collectives", lambda: check_collectives(args.ranks, backend)),
        "compressors": ("compressors", lambda: check_compressors(torch.device(args.device))),
        # On the CPU, tests/test_host_syncs.py checks the same on the meta device.
        **({"host-syncs": ("compressors", lambda: check_host_syncs(torch.device("cuda")))} if args.device == "cuda"
           else {}),
        "train-" + ("fp16" if args.device == "cuda" else "bf16"): (
            "train", lambda: check_train(args.device, "sim", 2, args.corpus)),
        "train-" + backend: ("train", lambda: check_train(args.device, backend, 1, args.corpus)),
        "bench": ("bench", lambda: check_bench(args.device)),
    }
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                               "torch": torch.__version__, "checks": {}}
    for name, (group, fn) in plan.items():
        if group not in only:
            continue
        t0 = time.monotonic()
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001 - a crashing check is a failed check, and the others still run
            res = {"ok": False, "detail": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        res["seconds"] = round(time.monotonic() - t0, 1)
        results["checks"][name] = res
        print(f"{name:16s} {'ok' if res['ok'] else 'FAILED':7s} {res['seconds']:7.1f} s  {res['detail']}", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    failed = [k for k, v in results["checks"].items() if not v["ok"]]
    print(f"gpu_check on {results['device']}: {len(results['checks']) - len(failed)}/{len(results['checks'])} ok"
          + (f"; FAILED: {', '.join(failed)}" if failed else "") + f" -> {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
