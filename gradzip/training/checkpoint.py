"""Checkpoints of ``gradzip train``: atomic, sharded per rank, loadable with ``weights_only=True``.

Layout in the run directory, for the checkpoint after optimizer step ``S`` (8-digit, zero-padded
so that names sort by step)::

    ckpt-0000000S.pt            rank 0: everything shared by the ranks + rank 0's own state
    ckpt-0000000S-rank<r>.pt    rank r > 0 (real backends only): rank r's own state

*Shared* state is identical on every rank, so one copy is kept: the model, the optimizer (both in
full, gathered from the shards under ``--fsdp``/``--hsdp``: :mod:`gradzip.training.sharding`), the LR
schedule, the GradScaler, the data position (the step: batches are a pure function of it), the
progress counters and the config. *Own* state differs per rank: the compressor state
(``engine.state_dict()``: error memory, PowerSGD's Q, ...) and the RNG states. With ``sim``, one
process hosts every worker, so the rank-0 file holds every worker's compressor and RNG state and
there are no shards. Sharding (rather than gathering to rank 0) keeps compressor state off the
communicator, whose byte counts are the experiment's measurements; it needs a directory that every
rank can reach (a shared file system across nodes).

Writes are atomic (temporary file in the same directory, fsync, ``os.replace``), and every rank
writes its shard *before* rank 0 writes its file (a barrier in between), so a rank-0 file means
the checkpoint is complete. Only the newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import os
import random
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradzip.errors import GradzipError
from gradzip.io import atomic_write, stale_temps
from gradzip.training.config import TrainConfig, load_toml
from gradzip.training.sharding import full_state, load_full_state

FORMAT = "gradzip-checkpoint"
VERSION = 1
_MAIN = re.compile(r"ckpt-(\d{8})\.pt")


def checkpoint_path(directory: str | os.PathLike[str], step: int, rank: int = 0) -> Path:
    suffix = "" if rank == 0 else f"-rank{rank}"
    return Path(directory) / f"ckpt-{step:08d}{suffix}.pt"


def list_checkpoints(directory: str | os.PathLike[str], rank: int = 0) -> list[tuple[int, Path]]:
    """``(step, path)`` of this rank's checkpoint files, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    pat = _MAIN if rank == 0 else re.compile(rf"ckpt-(\d{{8}})-rank{rank}\.pt")
    found = [(int(m.group(1)), d / name) for name in os.listdir(d) if (m := pat.fullmatch(name))]
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike[str]) -> tuple[int, Path] | None:
    """The newest complete checkpoint (its rank-0 file), or None."""
    found = list_checkpoints(directory, 0)
    return found[-1] if found else None


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file next to ``path``, fsync, then rename over ``path``."""
    atomic_write(path, lambda f: torch.save(obj, f), durable=True)


def save(directory: str | os.PathLike[str], step: int, rank: int, shared: dict[str, Any] | None,
         own: dict[str, Any], keep: int) -> Path:
    """Write this rank's file for ``step`` and delete this rank's files beyond the newest ``keep``.

    ``shared`` is given on rank 0 only. Real backends: call on every rank > 0 first, then a
    barrier, then rank 0 (see the module docstring).
    """
    obj: dict[str, Any] = {"format": FORMAT, "version": VERSION, "step": step, "rank": rank, "own": own}
    if rank == 0:
        if shared is None:
            raise ValueError("rank 0 must save the shared state")
        obj["shared"] = shared
    path = checkpoint_path(directory, step, rank)
    atomic_save(obj, path)
    # A shard is written before rank 0's file completes its checkpoint: ranks > 0 keep one more, so
    # that a crash in between still leaves the newest complete checkpoint with all its shards.
    for _, old in list_checkpoints(directory, rank)[:-(keep if rank == 0 else keep + 1)]:
        old.unlink(missing_ok=True)
    return path


class UnreadableCheckpoint(GradzipError):
    """A checkpoint file that is missing, truncated or not gradzip's: ``--resume`` falls back past it."""


def read(path: Path, rank: int = 0) -> dict[str, Any]:
    """Load one checkpoint file; any problem is a one-line :class:`GradzipError`
    (:class:`UnreadableCheckpoint` when the file itself is unusable)."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UnreadableCheckpoint(f"checkpoint {path} is missing") from None
    except Exception as e:  # truncated zip, pickle error, foreign object: all are "unusable"
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        why = next((ln for ln in lines if "Unpickler error" in ln), lines[0])[:200]
        raise UnreadableCheckpoint(f"checkpoint {path} is truncated or not a gradzip checkpoint ({why}); "
                           "delete it to resume from an earlier one, or start a new --out") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise UnreadableCheckpoint(f"{path} is not a gradzip checkpoint (no {FORMAT!r} marker); "
                           "point --out at a directory written by gradzip train")
    if obj.get("version") != VERSION:
        raise GradzipError(f"checkpoint {path} has format version {obj.get('version')}, "
                           f"this gradzip reads version {VERSION}")
    if obj.get("rank") != rank or (rank == 0 and "shared" not in obj):
        raise GradzipError(f"checkpoint {path} is rank {obj.get('rank')}'s file, expected rank {rank}'s")
    return obj


def load(directory: str | os.PathLike[str], step: int, rank: int, world_size: int) -> tuple[dict, dict]:
    """``(shared, own)`` of checkpoint ``step`` for ``rank``."""
    main = read(checkpoint_path(directory, step, 0), 0)
    saved_world = main["shared"].get("world_size")
    if saved_world != world_size:
        raise GradzipError(f"checkpoint step {step} was written by {saved_world} ranks, this run has "
                           f"{world_size}; resume with the same --workers / launcher size")
    if rank == 0:
        return main["shared"], main["own"]
    shard_path = checkpoint_path(directory, step, rank)
    if not shard_path.exists():
        raise UnreadableCheckpoint(f"checkpoint step {step} lacks rank {rank}'s shard {shard_path.name}; "
                           "every rank must see the same --out directory (a shared file system)")
    shard = read(shard_path, rank)
    if shard["step"] != step:
        raise GradzipError(f"{shard_path} holds step {shard['step']}, expected {step}")
    return main["shared"], shard["own"]


# ---------------------------------------------------------------------- RNG states
def host_rng_state() -> dict[str, Any]:
    """numpy's and Python's global RNG states, as tensors and numbers (weights_only-safe).
    (torch's generators are per worker: see :class:`gradzip.training.rng.WorkerRNG`.)"""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, py_gauss = random.getstate()
    return {
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": {"version": int(version), "state": [int(x) for x in internal], "gauss": py_gauss},
    }


def set_host_rng_state(state: dict[str, Any]) -> None:
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))


# ---------------------------------------------------------------------- a whole run
@dataclass
class RunState:
    """Everything a training run checkpoints. ``progress`` holds the step (the data position)
    and the cumulative counters (tokens, samples, wall_s, host_s, initial_eval_loss)."""

    model: Any
    optimizer: Any
    schedule: Any
    precision: Any
    sync: Any  # the Synchronizer; its state is saved under "engine" (the key of every checkpoint so far)
    rngs: Any
    progress: dict[str, Any]
    config: dict[str, Any]


def save_run(directory: str | os.PathLike[str], st: RunState, runtime: Any, keep: int) -> None:
    """Write the checkpoint of step ``st.progress["step"]`` on every rank (shards first)."""
    step = int(st.progress["step"])
    own = {"engine": st.sync.state_dict(), "rng": st.rngs.state_dict(), "host_rng": host_rng_state()}
    model_sd, optim_sd = full_state(st.model, st.optimizer, runtime.rank == 0)  # sharded: gathered (collective)
    if runtime.rank != 0:
        save(directory, step, runtime.rank, None, own, keep)
    runtime.barrier()  # every shard is on disk before rank 0's file marks the checkpoint complete
    if runtime.rank == 0:
        shared = {
            "world_size": runtime.num_workers, "config": st.config, "progress": dict(st.progress),
            "model": model_sd, "optimizer": optim_sd,
            "schedule": st.schedule.state_dict(), "scaler": st.precision.state_dict(),
        }
        save(directory, step, 0, shared, own, keep)


def _newest_loadable(directory: str | os.PathLike[str], runtime: Any) -> tuple[tuple[int, Path], dict, dict]:
    """The newest checkpoint whose files load on every rank. Every rank tries the same steps,
    newest first, and one tiny collective per try says whether all of them could read theirs."""
    everyone = 1.0 if runtime.comm is None else float(runtime.comm.world_size)
    skipped: list[str] = []
    first_error: GradzipError | None = None
    for step, path in reversed(list_checkpoints(directory, 0)):
        try:
            shared, own = load(directory, step, runtime.rank, runtime.num_workers)
            ok = 1.0
        except UnreadableCheckpoint as e:
            shared, own, ok = {}, {}, 0.0
            first_error = first_error or e
        if runtime.sum_over_ranks([ok])[0] == everyone:
            if skipped and runtime.rank == 0:
                warnings.warn(f"--resume: skipped unreadable checkpoint(s) {', '.join(skipped)}; "
                              f"resuming from step {step}", stacklevel=3)
            return (step, path), shared, own
        skipped.append(path.name)
    if first_error is not None:
        raise first_error
    raise GradzipError(f"--resume: no checkpoint in {directory} loads on every rank (another rank's files "
                       "are unreadable; see its message)")


def fresh_start_note(cfg: TrainConfig, out: Path) -> str | None:
    """``--resume auto`` with nothing to resume in ``out``: the one line that says a fresh run starts."""
    if not (cfg.resume and cfg.resume_auto) or latest_checkpoint(out) is not None:
        return None
    why = "does not exist" if not out.exists() else "holds no checkpoint" if any(out.iterdir()) else "is empty"
    return f"gradzip train: --resume auto: {out} {why}; starting a fresh run there"


def restore_run(directory: str | os.PathLike[str], st: RunState, runtime: Any) -> bool:
    """Load the newest checkpoint that every rank can read into ``st`` (in place), warning about
    the newer ones skipped. False if there is none at all."""
    if latest_checkpoint(directory) is None:
        return False
    found, shared, own = _newest_loadable(directory, runtime)
    try:
        load_full_state(st.model, st.optimizer, shared["model"], shared["optimizer"])
        st.schedule.load_state_dict(shared["schedule"])
        st.precision.load_state_dict(shared["scaler"])
        st.sync.load_state_dict(own["engine"])
        st.rngs.load_state_dict(own["rng"])
        set_host_rng_state(own["host_rng"])
    except (KeyError, RuntimeError, ValueError) as e:
        raise GradzipError(f"checkpoint {found[1]} does not fit this run ({str(e).splitlines()[0][:200]}); "
                           "resume with the settings it was written with") from None
    st.progress.update(shared["progress"])
    return True


def remove_stale_temps(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete the temporary files of checkpoint saves that a kill interrupted (they can be hundreds
    of MB each). Call before any rank saves; returns what was removed."""
    gone = stale_temps(directory, "ckpt-")
    for q in gone:
        q.unlink(missing_ok=True)
    if gone:
        warnings.warn(f"removed {len(gone)} temporary file(s) of interrupted checkpoint saves in {directory}",
                      stacklevel=2)
    return gone


# ---------------------------------------------------------------------- output directory
def make_out_dir(out: Path) -> None:
    """Create ``--out`` (and its parents), or stop with one line saying why it cannot be."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GradzipError(f"--out {out}: cannot create it ({e.strerror or type(e).__name__}); "
                           "choose a directory you can write to") from None


def check_out_dir(cfg: TrainConfig) -> Path:
    """Refuse a non-empty ``--out`` unless resuming; when resuming, refuse a changed config.
    Reads only: nothing is created or touched here (every rank checks; :func:`make_out_dir`
    creates it later, with a one-line error if it cannot be)."""
    out = Path(cfg.out or "")
    if out.exists() and not out.is_dir():
        raise GradzipError(f"--out {out} exists and is not a directory; choose another --out")
    nonempty = out.is_dir() and any(out.iterdir())
    if nonempty and not cfg.resume:
        raise GradzipError(f"--out {out} exists and is not empty; pass --resume to continue that run, "
                           "or choose another --out")
    if cfg.resume and not nonempty and not cfg.resume_auto:
        what = "is empty" if out.is_dir() else "does not exist"
        raise GradzipError(f"--resume: --out {out} {what}, so there is no run to continue; check the path, "
                           "or pass --resume auto to start a fresh run when there is nothing to resume")
    if cfg.resume and nonempty:
        found = latest_checkpoint(out)
        if found is None and not (cfg.resume_auto and (out / "config.toml").is_file()):
            raise GradzipError(f"--resume: {out} holds no checkpoint (ckpt-*.pt) to continue from; "
                               "run with --checkpoint-every N, or choose another --out")
        if found is None:  # --resume auto: a run stopped before its first checkpoint starts again
            return out
        if cfg.steps < found[0]:  # a shorter run would rewrite history: its config would contradict the files
            raise GradzipError(f"--resume --steps {cfg.steps}: the run in {out} has done {found[0]} steps; "
                               f"resume with --steps {found[0]} or more (more extends its schedule), "
                               "or choose another --out")
    saved = out / "config.toml"
    if cfg.resume and saved.exists():
        old = TrainConfig.from_dict(load_toml(saved), source=str(saved))
        changed = cfg.diff(old)
        if changed:
            raise GradzipError(f"--resume: the run in {out} used different settings ({'; '.join(changed)}); "
                               "resume with the same settings, or choose another --out")
    return out
