"""``--sync ftdiloco``: DiLoCo that survives its replicas, on torchft (``pip install "gradzip[ft]"``).

Every ``gradzip train`` run is one *replica group* of one or more gloo ranks, each rank with a
torchft Manager of the group (rank 0's serves the group's quorum); a Lighthouse
(``lighthouse=local``: started by rank 0; else its ``http://host:port``) forms a quorum of the
groups alive at each sync. Per sync, every ``every`` inner steps:

1. quorum: ``manager.start_quorum()``; a group behind the quorum's step *heals* first (below);
2. Δ = θ_global − θ_local goes through the gradzip compressor (``--compressor``, error feedback
   with ``ef=true``), and the payloads are allgathered on torchft's process group with a header of
   (weight, healed, group): the weight is the tokens the group trained on since its last committed
   sync (:meth:`FTDiLoCo.add_tokens`; without it, its inner steps). A group of weight 0 (just
   healed, or nothing trained since its last sync) sends an empty payload and its error memory
   stays as it was;
3. every participant decodes every payload and takes the weighted mean Σ wᵢ·Δᵢ / Σ wᵢ in quorum
   rank order (the same floats everywhere), the outer optimizer (Nesterov SGD) steps θ_global on it
   and θ_local ← θ_global;
4. ``manager.should_commit()``: committed only with ``min_replicas`` groups and no error (a peer
   lost mid-exchange); otherwise the error memory's update is undone, θ_global stays, and the
   group keeps training from its local parameters to the next sync.

Semantics (docs/fault-tolerance.md): a group that joins (a first start) or rejoins (a restart)
runs a *join sync* before its first inner step; torchft's quorum sends it the parameters θ_global,
the outer optimizer's state and the step of a live peer at the highest step, over its HTTP
checkpoint transport. A healed group resets its error memory (it is the residual of updates made
against a θ_global the cluster moved on from), contributes weight 0 to that sync, and logs the
sha256 digest of θ_global and the outer state, equal on every replica. **No fresh state wins**: a
quorum whose highest step is 0 holds only newborn groups; it commits only when it holds all
``groups`` (the run's founding sync), never when a restarted group finds itself alone.

A group of several ranks (``local``: their communicator) is DDP inside: every inner step's
gradients are averaged over its ranks (:meth:`FTDiLoCo.reduce_gradients`), so they hold one
θ_local; rank 0 alone compresses and exchanges Δ for the group (steps 2–3 below) and broadcasts the
averaged update to the others, and every rank takes the same outer step. torchft heals each rank
from the same rank of a live group.

Streaming DiLoCo (``fragments=P``, :mod:`gradzip.engine.ftsync_fragments`): fragment f of the
parameters syncs at inner step (f + 1)·H/P of each period, each in a quorum and commit of its own,
with its own weight (tokens since that fragment's last committed sync) and error memory
(``ft/f``); the delay τ is 0. SparseLoCo's outer step: :mod:`gradzip.engine.ftsparseloco`.

Each sync appends one line to ``ft.jsonl`` in the run's directory (join syncs included): the
quorum's members, the participants (weight > 0), the heals, the bytes per participant, whether it
committed, the digest; under ``gradzip train`` the step's line of ``metrics.jsonl`` carries the
same record as ``ft``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gradzip.comm.cost import allreduce_bytes, broadcast_bytes
from gradzip.compress.registry import create
from gradzip.engine import _ft
from gradzip.engine.ftsync_fragments import KEY, FragmentExchange, FragmentPlan
from gradzip.engine.modes import SyncSettings, register_sync
from gradzip.engine.stats import StepStats
from gradzip.engine.synchronizer import OptimizerStep, Synchronizer
from gradzip.errors import GradzipError
from gradzip.plan.sync import SyncSpec


class FTDiLoCo(FragmentExchange):
    """Fault-tolerant DiLoCo for one replica group (module docstring). ``groups``: the run's number
    of replica groups (its founding quorum); ``group``: this one's index; ``lighthouse``: an
    address, or ``"local"`` to start one here (on ``lighthouse_port``). ``guard=False`` turns off
    the fresh-state guard, only to show the failure it prevents. ``log``: the ``ft.jsonl`` path.
    ``host``: the address the other groups reach this one at (None: all on this machine).
    ``standby``: a warm spare: everything is built, then the group waits until this file exists
    before its Manager starts (and so before the Lighthouse sees it). ``local``: the communicator
    of the replica group's own ranks when it has several (DDP inside the group, module docstring);
    None: a group of one rank. ``lighthouse_wait``: seconds to wait for a Lighthouse given by address
    to answer (groups started together wait for the one that starts it)."""

    eval_on_every_rank = False
    mode = "ftdiloco"  # the --sync mode, in messages

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, outer: torch.optim.Optimizer,
                 every: int, compressor: str = "none", *, groups: int, group: int, lighthouse: str,
                 min_replicas: int = 1, lighthouse_port: int = 29510, timeout: float = 30.0,
                 log: str | Path | None = None, guard: bool = True, fragments: int = 1,
                 host: str | None = None, standby: str | Path | None = None, local: Any = None,
                 lighthouse_wait: float = 0.0) -> None:
        if groups < 1 or not 0 <= group < groups:
            raise GradzipError(f"--sync {self.mode}: group={group} must be in [0, groups={groups})")
        if not 1 <= min_replicas <= groups:
            raise GradzipError(f"--sync {self.mode}: min_replicas={min_replicas} must be in [1, groups={groups}]; "
                               "a quorum cannot hold more replica groups than the run has")
        if every < 1:
            raise GradzipError(f"--sync {self.mode}: every={every} must be >= 1")
        self.comp = create(compressor)
        if self.comp.rounds > 1:
            raise GradzipError(f"--sync {self.mode}: {self.comp.spec} takes {self.comp.rounds} rounds; the "
                               "fault-tolerant exchange is one allgather of payloads: use a single-round compressor")
        self.spec, self.model, self.inner, self.outer = self.comp.spec, model, inner, outer
        self.every, self.groups, self.group, self.min_replicas = every, groups, group, min_replicas
        self.local = local
        self.rank, self.size = (local.rank, local.world_size) if local is not None else (0, 1)
        self.guard, self.log = guard, Path(log) if log and self.rank == 0 else None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.plan = FragmentPlan.split([p.numel() for p in self.params], every, fragments, self.mode)
        with torch.no_grad():
            self.global_ = [p.detach().clone() for p in self.params]
        self.step = 0  # inner steps taken (θ_local's age), copied on a heal
        self.weights = [0.0] * self.plan.count  # per fragment: tokens (or inner steps) since its last committed sync
        self._tokens_given = False
        self._joined = False
        self._join_rec: dict[str, Any] | None = None  # the join sync's record, for the step's metrics
        self._healed = False  # set by a heal, read by the sync that caused it
        self._bad = 0
        self._norms: list[float] = []
        self._t_step: float | None = None  # when this step's forward began
        self._intra = 0  # bytes this rank sent inside its group since the last step's stats
        self.last_schedule: list[Any] = []
        self.last_digest = ""
        if standby is not None:
            _ft.await_file(Path(standby))
        server = None
        if lighthouse == "local":  # started by the group's rank 0; its port, to the others
            if self.rank == 0:
                server = _ft.start_lighthouse(min_replicas, port=lighthouse_port)
                lighthouse = server.address()
            if self.size > 1:
                port = self._share_port(int(lighthouse.rsplit(":", 1)[1]) if server is not None else 0)
                lighthouse = lighthouse if server is not None else f"http://{host or '127.0.0.1'}:{port}"
        else:
            _ft.check_lighthouse(lighthouse, wait=lighthouse_wait)
        self.ft = _ft.make_group(f"gradzip_group_{group}", lighthouse, min_replicas, self._load_peer,
                                 self._peer_state, timeout, host=host, rank=self.rank, world=self.size,
                                 share_port=self._share_port)
        self.ft.lighthouse = server

    # ------------------------------------------------------------------ the library API
    @property
    def weight(self) -> float:
        """The weight of the whole model's next pseudo-gradient (with fragments: fragment 0's)."""
        return self.weights[0]

    def add_tokens(self, n: float) -> None:
        """Count ``n`` tokens this rank trained on (the weight of the group's next pseudo-gradients is
        that times its ranks: each trains on as many)."""
        self._tokens_given = True
        self.weights = [w + float(n) for w in self.weights]

    def inner_step_done(self) -> dict[str, Any] | None:
        """The group took an inner step: count it, and sync at every ``every``-th (with
        ``fragments=P``: a fragment at every ``every/P``-th). Returns the sync's record
        (``ft.jsonl``'s line) or None."""
        self.ensure_joined()
        self.step += 1
        if not self._tokens_given:
            self.weights = [w + 1.0 for w in self.weights]
        return self.sync() if self.plan.due(self.step) else None

    def ensure_joined(self) -> None:
        """Before the first inner step: the join sync, repeated until one commits (a first start
        commits with the founding quorum, a restart after it heals from a live peer)."""
        while not self._joined:
            self._join_rec = self.sync(join=True)
            self._joined = bool(self._join_rec["committed"])

    def close(self) -> None:
        """Leave the quorum: the Manager (and a Lighthouse started here) shut down."""
        self.ft.close()

    # ------------------------------------------------------------------ the Synchronizer protocol
    @property
    def worker_ids(self) -> list[int]:
        return [self.rank]  # this rank of its replica group

    @property
    def exchange(self) -> str:
        return "allgather"

    def summary(self) -> dict[str, Any]:
        """``summary.json``: this group, the run's groups, the quorum floor, the last digest."""
        out = {"ft_group": self.group, "ft_groups": self.groups, "ft_min_replicas": self.min_replicas,
               "ft_syncs": self.ft.manager.current_step(), "ft_digest": self.last_digest, "ft_ranks": self.size}
        return out if self.plan.count == 1 else {**out, "ft_fragments": self.plan.count}

    def fp32_bytes(self, n_params: int) -> int:
        """The per-step baseline: a ring allreduce of ``n_params`` fp32 gradients over the groups."""
        return allreduce_bytes(4 * n_params, self.groups)

    @contextlib.contextmanager
    def worker(self, wid: int) -> Iterator[None]:
        """The group's step; the join sync runs before its first one. Zeroes ``.grad``."""
        self.ensure_joined()
        self._t_step = time.perf_counter()
        for p in self.params:
            p.grad = None
        yield

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def after_backward(self, stepper: OptimizerStep) -> None:
        """The inner step on the gradient (averaged over the group's ranks when it has several: the
        same on each, so the skip is the group's), or a skip when it is not finite."""
        self.reduce_gradients()
        sums = [torch.sum(p.grad, dtype=torch.float32) for p in self.params if p.grad is not None]
        if not sums or bool(torch.isfinite(torch.stack(sums).sum())):
            self._norms.append(stepper.step())
        else:
            stepper.skip()
            self._bad += 1

    def synchronize(self) -> StepStats:
        """Count the inner step; every ``every``-th, the sync. Bytes: this group's payload (its
        join sync's on its first step; sent by rank 0), and in a group of several ranks the
        gradient average and the update's broadcast inside it (``intra_bytes_sent``); ``syncs``:
        1 for a committed sync (join syncs, which carry no update of their own unless a resumed
        group brings one, are in ``ft`` alone)."""
        t0 = time.perf_counter()
        compute = t0 - (self._t_step or t0)
        rec = self.inner_step_done() or self._join_rec
        self._join_rec = None
        sent = int((rec or {}).get("bytes", {}).get(f"gradzip_group_{self.group}", 0)) if self.rank == 0 else 0
        dt = time.perf_counter() - t0
        intra, self._intra = self._intra, 0
        return StepStats(compute_s=compute, compress_s=0.0, comm_s=dt, bytes_sent=sent + intra, bytes_recv=0,
                         step_s=compute + dt, intra_bytes_sent=intra,
                         clock="measured", link_s=dt, nonfinite=self._bad,
                         syncs=int(bool(rec and rec["committed"] and not rec["join"])), ft=rec)

    def commit(self, nonfinite: int, stepper: OptimizerStep) -> float:
        norms, self._norms, self._bad = self._norms, [], 0
        return sum(norms) / len(norms) if norms else float("nan")

    def state_dict(self) -> dict[str, Any]:
        """The group's checkpoint: θ_global, θ_local, the outer and inner optimizers, the error
        memory, the step, the weights (``weight``: fragment 0's) and torchft's step (a resumed group
        rejoins at it)."""
        return {"spec": self.spec, "global": [g.clone() for g in self.global_],
                "local": [p.detach().clone() for p in self.params], "outer": self.outer.state_dict(),
                "inner": self.inner.state_dict(), "compressor": self.comp.state_dict(), "step": self.step,
                "weight": self.weights[0], "weights": list(self.weights), "manager": self.ft.manager.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("spec") != self.spec:
            raise GradzipError(f"{self.mode} state is for {sd.get('spec')!r}, not {self.spec!r}; resume with the same "
                               "--compressor")
        weights = [float(w) for w in sd.get("weights", [sd["weight"]])]
        if len(weights) != self.plan.count:
            raise GradzipError(f"{self.mode} state has {len(weights)} fragment(s), not {self.plan.count}; resume "
                               "with the same fragments=")
        for g, s in zip(self.global_, sd["global"]):
            g.copy_(s)
        for p, s in zip(self.params, sd["local"]):
            p.copy_(s)
        self.outer.load_state_dict(sd["outer"])
        self.inner.load_state_dict(sd["inner"])
        self.comp.load_state_dict(sd["compressor"])
        self.step, self.weights = int(sd["step"]), weights
        self.ft.manager.load_state_dict(sd["manager"])
        self._joined = False  # a resumed group rejoins (and heals if the cluster went on without it)

    def detach(self) -> None:
        """Nothing hooked; leaves the quorum."""
        self.close()

    # ------------------------------------------------------------------ one sync
    @torch.no_grad()
    def sync(self, join: bool = False) -> dict[str, Any]:
        """One fault-tolerant sync (module docstring); returns its ``ft.jsonl`` record. With
        fragments, the fragment is the one due at this group's step after the quorum (a healed
        group's step is its peer's): :meth:`FragmentPlan.at`."""
        m, t0 = self.ft.manager, time.perf_counter()
        self._healed = False
        m.start_quorum()
        q = self.ft.recorder.last
        members = [r.split(":")[0] for r in q.replica_ids]
        fresh = q.max_step == 0 and len(members) < self.groups
        frag = self.plan.at(self.step)
        rec: dict[str, Any] = {"step": self.step, "sync": m.current_step(), "quorum_id": q.quorum_id,
                               "members": members, "join": join, "healed": self._healed}
        if self.plan.count > 1:
            rec["fragment"] = frag
        results: list[tuple[list[float], tuple[Tensor, ...]]] = []
        ctx: Any = None
        self.comp.begin_step()
        if fresh and self.guard:
            m.report_error(GradzipError(f"quorum of {len(members)} newborn group(s) of {self.groups}: "
                                        "a fresh state never commits before the founding quorum"))
            rec["refused"] = "fresh"
        elif m.errored() is None and self.rank == 0:  # rank 0 exchanges for its group (docstring)
            try:
                results, ctx = self._exchange(frag, m.num_participants())
                rec["bytes"] = {f"gradzip_group_{int(h[2])}": _ft.payload_nbytes(p) for h, p in results}
            except Exception as e:  # a peer lost mid-exchange: torchft decides (no commit)
                m.report_error(e)
                rec["error"] = f"{type(e).__name__}: {e}"[:300]
                results = []
        if (err := m.errored()) is not None and "error" not in rec:
            rec["error"] = str(err.original_exception)[:300]
        committed = m.should_commit()
        self.comp.end_step(committed)
        if committed and frag is not None:
            self._apply(frag, results, ctx)
        rec.update(committed=committed, participants=[f"gradzip_group_{int(h[2])}" for h, _ in results if h[0] > 0],
                   heals=[f"gradzip_group_{int(h[2])}" for h, _ in results if h[1] > 0],
                   weights={f"gradzip_group_{int(h[2])}": h[0] for h, _ in results},
                   digest=self.digest(), sync_s=time.perf_counter() - t0)
        rec["sync"] = m.current_step()
        self.last_digest = rec["digest"]
        self._write(rec)
        return rec

    # ------------------------------------------------------------------ healing (torchft's transport)
    def _peer_state(self) -> dict[str, Any]:
        """What a healing group copies from this one: θ_global, the outer state, the step (copies:
        the transport may serve them while this group goes on)."""
        return {"global": [g.clone() for g in self.global_], "outer": copy.deepcopy(self.outer.state_dict()),
                "step": self.step}

    @torch.no_grad()
    def _load_peer(self, sd: dict[str, Any]) -> None:
        """Heal: take a live peer's θ_global, outer state and step; θ_local ← θ_global; the error
        memory and the weight reset (nothing this group did since is on the cluster's trajectory)."""
        for g, s in zip(self.global_, sd["global"]):
            g.copy_(s)
        self.outer.load_state_dict(sd["outer"])
        for p, g in zip(self.params, self.global_):
            p.copy_(g)
        self.step = int(sd["step"])
        self.comp.forget(KEY)
        self.weights = [0.0] * self.plan.count
        self._healed = True

    def digest(self) -> str:
        """sha256 of θ_global and the outer optimizer's state (equal on every replica after a sync)."""
        return _ft.digest(self.global_, self.outer.state_dict())

    # ------------------------------------------------------------------ inside a group of several ranks
    def _share_port(self, port: int) -> int:
        """Rank 0's store port, to every rank of the group (a broadcast on the group's communicator)."""
        t = torch.tensor([port], dtype=torch.int64)
        self.local.broadcast(t, 0)
        return int(t.item())

    def reduce_gradients(self) -> None:
        """DDP inside the group: each gradient becomes its mean over the group's ranks (one flat
        fp32 allreduce on the group's communicator, which times it out and names a lost rank).
        Call it after ``backward()`` and before the inner step; nothing with a group of one rank."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.size == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        self.local.allreduce(flat, "sum")
        flat.div_(self.size)
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()
        self._intra += allreduce_bytes(4 * flat.numel(), self.size)

    def _share_update(self, frag: int, avg: Tensor | None) -> Tensor | None:
        """Rank 0's averaged pseudo-gradient of fragment ``frag`` (or None: every weight was 0), to
        every rank of the group, which then takes the same outer step."""
        n = sum(self.global_[i].numel() for i in self.plan.parts[frag])
        buf = torch.zeros(n + 1, dtype=torch.float32)  # the last value: 1 when there is an update
        if self.rank == 0 and avg is not None:
            buf[:n].copy_(avg)
            buf[n] = 1.0
        self.local.broadcast(buf, 0)
        self._intra += broadcast_bytes(4 * (n + 1), self.size, self.rank)[0]
        return buf[:n] if buf[n] > 0 else None

    def _write(self, rec: dict[str, Any]) -> None:
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with self.log.open("a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")


# The keys every fault-tolerant mode takes, after its own (ftsparseloco's: gradzip/engine/ftsparseloco.py).
FT_KEYS = ("groups", "group", "min_replicas", "lighthouse", "lighthouse_port", "lighthouse_wait", "host", "standby")
FT_DEFAULTS = {"groups": "1", "group": "0", "min_replicas": "1", "lighthouse": "local", "lighthouse_port": "29510",
               "lighthouse_wait": "30"}


def options(sync: SyncSpec) -> dict[str, Any]:
    """A fault-tolerant mode's own keys, typed and checked: groups, group, min_replicas,
    lighthouse, lighthouse_port, lighthouse_wait, host, standby; and delay = 0. A
    :class:`GradzipError` (one line) for a value out of range."""
    opts, mode = dict(sync.options), sync.mode
    try:
        groups, group, floor, port = (int(opts[k]) for k in ("groups", "group", "min_replicas", "lighthouse_port"))
    except ValueError:
        raise GradzipError(f"--sync {mode}: groups, group, min_replicas and lighthouse_port are integers, got "
                           + ",".join(f"{k}={opts[k]}" for k in ("groups", "group", "min_replicas",
                                                                   "lighthouse_port"))) from None
    if groups < 1 or not 0 <= group < groups:
        raise GradzipError(f"--sync {mode}: group={group} must be in [0, groups={groups})")
    if not 1 <= floor <= groups:
        raise GradzipError(f"--sync {mode}: min_replicas={floor} must be in [1, groups={groups}]; "
                           "a quorum cannot hold more replica groups than the run has")
    try:
        wait = float(opts["lighthouse_wait"])
    except ValueError:
        wait = -1.0
    if not 0 <= wait < float("inf"):
        raise GradzipError(f"--sync {mode}: lighthouse_wait={opts['lighthouse_wait']} must be a number of seconds >= 0")
    if sync.delay:
        raise GradzipError(f"--sync {mode}: delay={sync.delay} is not fault-tolerant: a fragment is applied at the "
                           "step it is sent, inside its quorum and commit; give delay=0")
    return {"groups": groups, "group": group, "min_replicas": floor, "lighthouse": opts["lighthouse"],
            "lighthouse_port": port, "lighthouse_wait": wait, "host": opts.get("host") or None,
            "standby": opts.get("standby") or None}


def check_reachable(sync: SyncSpec) -> None:
    """What this machine must offer a fault-tolerant run: torchft installed (the ``ft`` extra)
    and, unless ``lighthouse=local``, a Lighthouse answering at its address; one line otherwise."""
    _ft.torchft()
    o = options(sync)
    if (addr := o["lighthouse"]) != "local":
        _ft.check_lighthouse(addr, wait=o["lighthouse_wait"])


def group_kwargs(target: Any, s: SyncSettings) -> dict[str, Any]:
    """The replica group's keyword arguments of :class:`FTDiLoCo` from ``--sync`` (:func:`options`),
    for a run on real ranks (``--backend gloo --workers R``: the group's R ranks, DDP inside it);
    a :class:`GradzipError` otherwise."""
    if not isinstance(getattr(target, "world_size", None), int) or not hasattr(target, "broadcast"):
        raise GradzipError(f"--sync {s.sync.mode} runs each replica group on real ranks: start each group as its "
                           "own gradzip train --backend gloo --workers R run, with group=I")
    o = options(s.sync)
    return {"groups": o["groups"], "group": o["group"], "lighthouse": o["lighthouse"],
            "min_replicas": o["min_replicas"], "lighthouse_port": o["lighthouse_port"], "host": o["host"],
            "standby": o["standby"], "lighthouse_wait": o["lighthouse_wait"], "timeout": s.timeout or 30.0,
            "log": Path(s.log_dir) / "ft.jsonl" if s.log_dir else None,
            "local": target if target.world_size > 1 else None}


def _build(model: torch.nn.Module, optimizer: torch.optim.Optimizer, target: Any,
           s: SyncSettings) -> Synchronizer:
    """One replica group per ``gradzip train`` process (``--backend gloo --workers 1``)."""
    kwargs = group_kwargs(target, s)
    params = [p for p in model.parameters() if p.requires_grad]
    outer = torch.optim.SGD(params, lr=s.sync.outer_lr, momentum=s.sync.momentum, nesterov=s.sync.nesterov)
    return FTDiLoCo(model, optimizer, outer, s.sync.every, s.spec, fragments=s.sync.fragments, **kwargs)


register_sync("ftdiloco", "fault-tolerant (Streaming) DiLoCo on torchft, one replica group per run (every=H,groups=N,"
              "group=I,min_replicas=1,lighthouse=local|http://HOST:PORT,host=ADDR,standby=FILE,outer_lr=0.7,momentum=0.9,"
              "fragments=1)",
              _build, keys=("every", "outer_lr", "momentum", "nesterov", "fragments", "delay", *FT_KEYS),
              defaults={"outer_lr": "0.7", "momentum": "0.9", "nesterov": "true", **FT_DEFAULTS},
              machine_check=check_reachable)
