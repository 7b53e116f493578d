"""``gradzip sweep SPEC.toml [--out DIR]``: run every cell of an experiment spec.

Layout of the sweep directory (default ``runs/<spec name>``)::

    sweep.json            spec (as parsed), every cell's parameters, status, time and error
    spec.toml             a copy of the spec file that was run
    <cell>/               one ``gradzip train`` run directory per cell (name from its grid values)
    <cell>/error.txt      only for a failed cell: the exit code, command and end of its output
    logs/<cell>.toml      the cell's configuration, as given to ``gradzip train --config``
    logs/<cell>.log       the cell's full output (subprocess mode)
    logs/stale/           earlier attempts that could not be resumed, moved aside (never deleted)
    results.md/.csv, figures/    written at the end (``gradzip plot``), unless --no-plot

Cells run one after the other (``--jobs N``: N at once, as child processes). Each cell is, in order:

1. *finished* (``summary.json`` present and its ``steps`` equal to the cell's ``steps``): skipped;
2. *interrupted* (a checkpoint is present): resumed (``gradzip train --resume``);
3. otherwise started afresh (a directory left by an attempt without a checkpoint is first moved
   to ``logs/stale/``).

A cell whose directory holds a run with *different* settings (the spec changed) fails with a
message instead of being skipped or overwritten. A failing cell does not stop the others; the exit
code is 0 only if every cell succeeded (1 otherwise, 2 for a bad spec).

How cells run:

- by default each cell is a child process, ``python -m gradzip train --config logs/<cell>.toml
  --out <cell>``: a crash (or an out-of-memory kill) of one cell cannot take the sweep down, and for
  ``gloo``/``mpi`` cells ``gradzip train`` itself starts the ``workers`` local processes;
- ``--in-process`` runs cells by calling :func:`gradzip.training.loop.train` in this process
  (less start-up time per cell; a Python exception is still caught and recorded);
- under an external launcher (``torchrun``, ``mpirun``, ``srun``: the user starts
  ``gradzip sweep`` itself under it), every rank runs every cell in-process, with the world size
  from the launcher; only rank 0 writes ``sweep.json``, logs and figures. Such specs use a real
  backend (``sim`` cells cannot run under a launcher).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradzip.comm.launch import detect_launcher_env
from gradzip.errors import GradzipError
from gradzip.experiments.downstream import downstream_step
from gradzip.experiments.spec import Cell, Spec, load_spec
from gradzip.io import atomic_write_json
from gradzip.plots.report import make_report, print_report
from gradzip.training.checkpoint import latest_checkpoint
from gradzip.training.config import TrainConfig, load_toml, write_toml
from gradzip.training.loop import train
from gradzip.training.sharding import ranks_per_node

TAIL_CHARS = 20_000  # end of a failed cell's output kept in error.txt
_CHILDREN: set[subprocess.Popen] = set()  # the cells' running child processes


@dataclass
class CellResult:
    name: str
    params: dict[str, Any]
    status: str = "pending"  # pending | running | done | skipped | failed
    resumed: bool = False
    seconds: float = 0.0
    error: str | None = None
    final_eval_loss: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = {"name": self.name, "params": self.params, "status": self.status, "resumed": self.resumed,
             "seconds": round(self.seconds, 3), "error": self.error, "final_eval_loss": self.final_eval_loss}
        d.update(self.extra)
        return d


# ---------------------------------------------------------------------- launcher environment
def launcher_rank() -> int | None:
    """This process's rank if torchrun/mpirun/srun started it, else None."""
    env = detect_launcher_env()
    return env.rank if env.external else None


# ---------------------------------------------------------------------- one cell
def _read_summary(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def cell_state(run_dir: Path, cfg: Any) -> str:
    """``finished``, ``resume``, ``fresh`` (no directory, or empty) or ``stale`` (leftovers, no checkpoint).

    Raises GradzipError if the directory holds a run with other settings than ``cfg``.
    """
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return "fresh"
    saved = run_dir / "config.toml"
    if saved.is_file():
        try:
            old = TrainConfig.from_dict(load_toml(saved), source=str(saved))
        except GradzipError:
            old = None
        changed = cfg.diff(old) if old is not None else []
        if changed:
            raise GradzipError(f"{run_dir} holds a run with other settings ({'; '.join(changed)}); the spec "
                               "changed since: use another --out, or move that directory away")
    summary = _read_summary(run_dir)
    if summary is not None and int(summary.get("steps") or 0) >= cfg.steps:
        return "finished"
    if latest_checkpoint(run_dir) is not None:
        return "resume"
    return "stale"


def _move_aside(run_dir: Path, stale_root: Path) -> Path:
    stale_root.mkdir(parents=True, exist_ok=True)
    k = 1
    while (stale_root / f"{run_dir.name}.{k}").exists():
        k += 1
    dest = stale_root / f"{run_dir.name}.{k}"
    shutil.move(str(run_dir), dest)
    return dest


def _write_error(run_dir: Path, text: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "error.txt").write_text(text, encoding="utf-8")


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "failed"


def _run_subprocess(cmd: list[str], log_path: Path, echo: bool) -> tuple[int, str]:
    """Run ``cmd``; its output goes to ``log_path`` and (if ``echo``) to our stderr. Returns (code, tail)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    tail = bytearray()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        assert proc.stdout is not None
        _CHILDREN.add(proc)

        def pump() -> None:
            # Chunks, not lines: progress bars redraw with '\r' and would otherwise stall.
            while chunk := proc.stdout.read1(65536):
                log.write(chunk)
                log.flush()
                tail.extend(chunk)
                if len(tail) > 2 * TAIL_CHARS:
                    del tail[: len(tail) - TAIL_CHARS]
                if echo:
                    out = getattr(sys.stderr, "buffer", None)  # absent in some embedded consoles
                    if out is not None:
                        out.write(chunk)
                        out.flush()
                    else:
                        sys.stderr.write(chunk.decode("utf-8", "replace"))

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        try:
            code = proc.wait()
        except BaseException:  # Ctrl-C: stop the child too, then let the interrupt through
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        finally:
            _CHILDREN.discard(proc)
            t.join(timeout=10)
    return code, bytes(tail[-TAIL_CHARS:]).decode("utf-8", "replace")


def _stop_children() -> None:
    """Terminate every running cell's child (``--jobs``: the interrupt reaches the main thread only)."""
    for proc in list(_CHILDREN):
        proc.terminate()
    for proc in list(_CHILDREN):
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_cell(cell: Cell, sweep_dir: Path, in_process: bool, main: bool = True, echo: bool = True) -> CellResult:
    """Run (or skip, or resume) one cell. Never raises for a failing cell: the result says so."""
    res = CellResult(cell.name, cell.params)
    run_dir = sweep_dir / cell.name
    t0 = time.monotonic()
    try:
        cfg = TrainConfig.from_dict(cell.config, source=f"cell {cell.name}")
        if in_process and cfg.real_backend:  # under a launcher: the world size is the launcher's
            cfg = cfg.replace(workers=detect_launcher_env().world_size)
        state = cell_state(run_dir, cfg)
    except GradzipError as e:
        # The directory holds someone else's run: report, but write nothing into it.
        res.status, res.error = "failed", str(e)
        return res
    if state == "finished":
        res.status = "skipped"
        res.final_eval_loss = (_read_summary(run_dir) or {}).get("final_eval_loss")
        return res
    res.resumed = state == "resume"
    logs = sweep_dir / "logs"
    if state == "stale":
        if main:
            _move_aside(run_dir, logs / "stale")
        else:  # under a launcher: rank 0 moves it; the others wait so that nobody sees a non-empty --out
            deadline = time.monotonic() + 120
            while run_dir.exists() and any(run_dir.iterdir()) and time.monotonic() < deadline:
                time.sleep(0.5)
    cfg = cfg.replace(out=str(run_dir), resume=res.resumed)
    if in_process:
        try:
            summary = train(cfg)
            res.status = "done"
            res.final_eval_loss = (summary or {}).get("final_eval_loss")
        except Exception as e:  # noqa: BLE001 - a failing cell must not stop the sweep
            res.status = "failed"
            res.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            if main:
                _write_error(run_dir, f"cell {cell.name} failed in-process\n\n{traceback.format_exc()}")
    else:
        logs.mkdir(parents=True, exist_ok=True)
        cfg_path = logs / f"{cell.name}.toml"
        write_toml(cfg.replace(out=None, resume=False), cfg_path)
        cmd = [sys.executable, "-m", "gradzip", "train", "--config", str(cfg_path), "--out", str(run_dir)]
        if res.resumed:
            cmd.append("--resume")
        code, tail = _run_subprocess(cmd, logs / f"{cell.name}.log", echo)
        summary = _read_summary(run_dir)
        if code == 0 and summary is not None:
            res.status = "done"
            res.final_eval_loss = summary.get("final_eval_loss")
        else:
            res.status = "failed"
            res.error = f"exit code {code}: {_last_line(tail)}"
            _write_error(run_dir, f"cell {cell.name} failed with exit code {code}\ncommand: {' '.join(cmd)}\n"
                                  f"full output: {logs / (cell.name + '.log')}\n\n--- end of output ---\n{tail}")
    res.seconds = time.monotonic() - t0
    return res


# ---------------------------------------------------------------------- the sweep
def default_out(spec: Spec) -> Path:
    return Path("runs") / spec.name


def run_sweep(spec: Spec, out: Path, in_process: bool | None = None, echo: bool = True,
              command: str | None = None, jobs: int = 1) -> list[CellResult]:
    """Run every cell of ``spec`` into ``out`` (see the module docstring); writes ``sweep.json``.

    ``command`` is recorded there (and shown with the figures) as the command that made the sweep.
    ``jobs``: cells run at once (child processes only; e.g. 2 one-thread runs on 2 cores).
    """
    if jobs < 1:
        raise GradzipError(f"--jobs must be >= 1, got {jobs}")
    rank = launcher_rank()
    if rank is not None:
        sims = [c.name for c in spec.cells if c.config.get("backend", "sim") == "sim"]
        if sims:
            raise GradzipError(f"{spec.path}: cell {sims[0]} uses backend sim, which cannot run under a launcher "
                               "(torchrun/mpirun/srun); start `gradzip sweep` without it, or use a real backend")
        netems = [c.name for c in spec.cells if c.config.get("netem")]
        if netems:
            raise GradzipError(f"{spec.path}: cell {netems[0]} runs in the network testbed (a real backend with "
                               "`bandwidth`), which gradzip must launch itself; start `gradzip sweep` without "
                               "torchrun/mpirun/srun, or drop `bandwidth` from the spec")
        in_process = True
    elif in_process:
        # Without a launcher, a gloo/mpi cell trained in this process would be a world of one rank.
        real = [c.name for c in spec.cells if c.config.get("backend", "sim") != "sim"]
        if real:
            raise GradzipError(f"{spec.path}: cell {real[0]} uses a real backend, whose processes the runner "
                               "starts itself; drop --in-process (or start the sweep under torchrun/mpirun/srun)")
    main = rank in (None, 0)
    in_process = bool(in_process)
    if jobs > 1 and in_process:
        raise GradzipError("--jobs runs cells as child processes; drop --in-process (or --jobs), and start the "
                           "sweep without torchrun/mpirun/srun")
    if out.exists() and not out.is_dir():
        raise GradzipError(f"--out {out} exists and is not a directory; choose another --out")
    results = [CellResult(c.name, c.params) for c in spec.cells]
    state: dict[str, Any] = {"spec": spec.to_json(), "spec_file": str(spec.path),
                             "command": command or f"gradzip sweep {spec.path}", "started": time.time(),
                             "finished": None, "mode": "in-process" if in_process else "subprocess", "cells": []}

    def save() -> None:
        if main:
            state["cells"] = [r.to_json() for r in results]
            atomic_write_json(out / "sweep.json", state)

    if main:
        out.mkdir(parents=True, exist_ok=True)
        if spec.path.is_file() and spec.path.resolve() != (out / "spec.toml").resolve():
            shutil.copyfile(spec.path, out / "spec.toml")
        save()
    with _terminate_as_exit():
        _run_cells(spec, out, in_process, main, echo, results, save, jobs)
    state["finished"] = time.time()
    save()
    return results


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM (e.g. a batch scheduler's time limit) raises SystemExit, so that a running child
    cell is terminated too instead of being left behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _run_cells(spec: Spec, out: Path, in_process: bool, main: bool, echo: bool, results: list[CellResult],
               save: Any, jobs: int = 1) -> None:
    """Every cell in spec order; with ``jobs`` > 1 (child processes only) that many at once, each
    child's output going to its log alone."""
    n = len(spec.cells)
    lock = threading.Lock()  # results, sweep.json and the progress lines are shared by the threads
    echo = echo and jobs == 1

    stop = threading.Event()  # set on an interrupt: no further cell starts

    def one(i: int) -> None:
        cell = spec.cells[i]
        if stop.is_set():
            return
        with lock:
            if main:
                print(f"[{i + 1}/{n}] {cell.name}", flush=True)
            results[i].status = "running"
            save()
        r = run_cell(cell, out, in_process, main=main, echo=echo)
        with lock:
            results[i] = r
            if main:
                note = {"skipped": "already finished, skipped", "done": f"done in {r.seconds:.1f} s"
                        + (" (resumed)" if r.resumed else ""), "failed": f"FAILED: {r.error}"}[r.status]
                print(f"[{i + 1}/{n}] {cell.name}: {note}", flush=True)
        if main and spec.downstream is not None and r.status in ("done", "skipped"):
            err = downstream_step(out / cell.name, cell.config, spec.downstream, echo)
            if err:
                print(f"[{i + 1}/{n}] {cell.name}: downstream FAILED: {err}", flush=True)
        with lock:
            save()

    if jobs == 1:
        for i in range(n):
            one(i)
        return
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        for f in [pool.submit(one, i) for i in range(n)]:
            f.result()
    except BaseException:  # Ctrl-C or SIGTERM: stop the running cells too, start no more
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        _stop_children()
        raise
    pool.shutdown()


def summary_table(results: list[CellResult]) -> str:
    width = max(len(r.name) for r in results)
    lines = [f"{'cell'.ljust(width)}  status   time (s)  final eval loss"]
    for r in results:
        status = r.status + ("*" if r.resumed else "")
        loss = f"{r.final_eval_loss:.4f}" if isinstance(r.final_eval_loss, (int, float)) else "—"
        lines.append(f"{r.name.ljust(width)}  {status:<8} {r.seconds:8.1f}  {loss}")
    failed = [r for r in results if r.status == "failed"]
    counts = {s: sum(r.status == s for r in results) for s in ("done", "skipped", "failed")}
    lines.append(f"{len(results)} cells: {counts['done']} run, {counts['skipped']} skipped (finished before), "
                 f"{counts['failed']} failed" + (" (* = resumed)" if any(r.resumed for r in results) else ""))
    for r in failed:
        lines.append(f"  {r.name}: {r.error}")
    return "\n".join(lines)


def finish(out: Path, results: list[CellResult], plot: bool = True) -> int:
    """Print the summary, then the results table and figure paths; return the exit code."""
    if launcher_rank() not in (None, 0):
        return 0 if all(r.status != "failed" for r in results) else 1
    print()
    print(summary_table(results))
    failed = any(r.status == "failed" for r in results)
    if plot and any(r.status != "failed" for r in results):
        print()
        try:
            print_report(make_report(out))
        except GradzipError as e:
            print(f"no figures: {e}")
    if failed:
        print(f"\nsome cells failed; their errors are in {out}/<cell>/error.txt. Re-running the same command "
              "skips the finished cells and retries the rest.")
    return 1 if failed else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC.toml", help="experiment spec (see gradzip/experiments/spec.py)")
    add_common_arguments(parser)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="DIR", help="sweep directory (default: runs/<spec name>)")
    parser.add_argument("--in-process", action="store_true",
                        help="run cells in this process instead of one child process each")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="cells run at once, as child processes (default 1); with OMP_NUM_THREADS=1, "
                             "one per core")
    parser.add_argument("--no-plot", action="store_true", help="do not draw figures and tables at the end")
    parser.add_argument("--dry-run", action="store_true", help="list the cells and their directories, run nothing")


def dry_run(spec: Spec, out: Path) -> int:
    """List the cells and their state. Beyond the validation of every cell when the spec loads, it
    checks what a cell's launch would refuse: ``--hsdp``'s node size against the cell's ranks
    (``workers``, or the launcher's world size when the sweep itself runs under one)."""
    launcher = detect_launcher_env()
    for c in spec.cells:
        cfg = TrainConfig.from_dict(c.config)
        if cfg.sharding == "hsdp":
            world = launcher.world_size if launcher.external else cfg.workers
            try:
                ranks_per_node(cfg.ranks_per_node, world, from_launcher=launcher.external)
            except GradzipError as e:
                raise GradzipError(f"{spec.path}: cell {c.name}: {e}") from None
    print(f"{spec.name}: {len(spec.cells)} cells into {out}")
    for c in spec.cells:
        state = "finished" if (out / c.name / "summary.json").is_file() else "to run"
        print(f"  {c.name}  ({state})")
    return 0


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    out = Path(args.out) if args.out else default_out(spec)
    if args.dry_run:
        return dry_run(spec, out)
    command = f"gradzip sweep {args.spec}" + (f" --out {args.out}" if args.out else "") \
        + (f" --jobs {args.jobs}" if args.jobs != 1 else "")
    results = run_sweep(spec, out, in_process=args.in_process, command=command, jobs=args.jobs)
    return finish(out, results, plot=not args.no_plot)
