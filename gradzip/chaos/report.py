"""What a chaos run's files say (:mod:`gradzip.chaos.harness`): ``summary.json`` and ``summary.md``.

Times are seconds from the founding sync (the harness read each line at most 0.1 s after it was
written). The measures:

- **syncs**: the committed syncs, one per (quorum id, torchft step), with their members,
  participants (weight > 0), heals and weights (inner steps since each one's last commit);
- **goodput**: committed tokens per second over the run's window [0, duration]: Σ over the
  committed syncs in it of the participants' weights × batch tokens (batch size × sequence length),
  over the window; ``goodput_ratio`` divides it by a fault-free run's (:func:`compare`);
- **participation**: per regular sync, its participants against the groups *live* then (a running,
  unstalled process on a connected host that had already joined); ``participation_ok``: every sync
  had at least live − 1;
- **faults**: per injected fault, its recovery: the time until the group's next committed sync (a
  partition: the slowest of the host's groups); a kill's restart also gives ``startup_s``, the time
  from the new process's launch to its first quorum request;
- **heals**: every heal's digest against the digest of a group that did not heal in the same sync;
- **final digests**: at the last sync every surviving group committed, each one's digest (a
  group's last process counts if it had rejoined by the end);
- **loss continuity**: per heal after the founding sync, the healed group's mean training loss
  over its first ``LOSS_STEPS`` steps after it, against the other members' first steps after the
  same sync (they start from the same θ_global); continuous when that jump is at most
  ``loss_bound``;
- **held-out loss**: every surviving group's last held-out loss in the window (every sync's
  held-out loss is the same on every group that committed it: θ_local = θ_global there), and the
  mean over the window's last ``LATE_S`` seconds.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

LOSS_STEPS = 4
LATE_S = 60.0


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class ChaosRun:
    """A chaos run's files, times shifted to the founding sync."""

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        self.settings = json.loads((self.out / "settings.json").read_text())
        self.events = _jsonl(self.out / "events.jsonl")
        founding = next((e["t"] for e in self.events if e["event"] == "founding"), None)
        if founding is None:
            raise ValueError(f"{self.out}: the run never reached its founding sync")
        self.t0 = founding
        for e in self.events:
            e["rel"] = e["t"] - founding
        rows = _jsonl(self.out / "timeline.jsonl")
        for i, r in enumerate(rows):
            r["rel"], r["i"] = r["t"] - founding, i  # i: the order the harness read them in
        self.ft = [r for r in rows if r["kind"] == "ft"]
        self.steps = [r for r in rows if r["kind"] == "step"]
        self.duration = float(self.settings["duration"])
        self.batch_tokens = int(self.settings["batch_size"]) * int(self.settings["seq_len"])

    def syncs(self) -> list[dict[str, Any]]:
        """The committed syncs in time order, each with the rows of the groups that logged it."""
        by: dict[tuple[Any, Any], dict[str, Any]] = {}
        for r in self.ft:
            rec = r["rec"]
            if not rec["committed"]:
                continue
            s = by.setdefault((rec["quorum_id"], rec["sync"]), {
                "rel": r["rel"], "sync": rec["sync"], "quorum_id": rec["quorum_id"], "members": rec["members"],
                "participants": rec["participants"], "heals": rec["heals"], "weights": rec["weights"],
                "join": True, "rows": []})
            s["rel"] = min(s["rel"], r["rel"])
            s["join"] = s["join"] and rec["join"]  # a founding sync; a restart's join is others' regular sync
            s["rows"].append(r)
        return sorted(by.values(), key=lambda s: s["rel"])

    def state_at(self, g: int, rel: float) -> dict[str, Any]:
        """Group ``g`` at time ``rel``: its process (inc) up or not, stalled, its host cut off."""
        up, inc, stalled, cut = False, None, False, False
        hosts = max(int(self.settings["hosts"]), 1)
        for e in self.events:
            if e["rel"] > rel:
                break
            ev = e["event"]
            if e.get("group") == g and ev == "launch":
                up, inc, stalled = True, e["inc"], False
            elif e.get("group") == g and ev in ("kill", "exit") and e.get("inc") == inc:
                up = False
            elif e.get("group") == g and ev == "stall":
                stalled = True
            elif e.get("group") == g and ev == "resume":
                stalled = False
            elif ev in ("partition", "link") and e.get("host") == g % hosts:
                cut = ev == "partition"
        return {"up": up, "inc": inc, "stalled": stalled, "cut": cut}

    def live_at(self, rel: float) -> list[int]:
        """Groups live at ``rel``: up, not stalled, not cut off, and joined before (a committed sync
        of this process earlier than ``rel``)."""
        out = []
        for g in range(int(self.settings["groups"])):
            st = self.state_at(g, rel)
            joined = any(r["group"] == g and r["inc"] == st["inc"] and r["rec"]["committed"] and r["rel"] < rel
                         for r in self.ft)
            if st["up"] and not st["stalled"] and not st["cut"] and joined:
                out.append(g)
        return out


def _gid(g: int) -> str:
    return f"gradzip_group_{g}"


def faults(run: ChaosRun) -> list[dict[str, Any]]:
    """Every injected (or skipped) fault with its recovery time."""
    out = []
    for e in run.events:
        if e["event"] not in ("kill", "stall", "partition", "skip", "late"):
            continue
        f = {"t": round(e["rel"], 2), "kind": e.get("kind", e["event"]), "fault": e.get("fault")}
        if e["event"] == "late":  # a late joiner: its launch to its first committed sync (its heal)
            out.append({**f, "kind": "late join", "target": e["group"], "groups": [e["group"]],
                        **_restart(run, e["group"], e["inc"]), "recovery_s": _first_commit(run, e)})
            continue
        if e["event"] == "skip":
            out.append({**f, "skipped": e["why"], "target": e.get("group", e.get("host"))})
            continue
        groups = e["groups"] if e["event"] == "partition" else [e["group"]]
        f["target"] = e.get("host", e.get("group"))
        rec = []
        for g in groups:
            back = _back(run, e, g)
            nxt = None if back is None else next(
                (r for r in run.ft if r["group"] == g and r["rel"] > back["rel"]
                 and r["inc"] == back.get("inc", r["inc"]) and r["rec"]["committed"]), None)
            rec.append(None if nxt is None else nxt["rel"] - e["rel"])
        f["recovery_s"] = None if None in rec or not rec else round(max(rec), 2)
        f["groups"] = groups
        if e["event"] == "kill":  # the process brought in: a new one, or a warm spare (any incarnation)
            back = _back(run, e, e["group"])
            f.update(_restart(run, e["group"], back["inc"]) if back else {"startup_s": None, "healed": None})
        out.append(f)
    return out


def _first_commit(run: ChaosRun, e: dict[str, Any]) -> float | None:
    first = next((r for r in run.ft if r["group"] == e["group"] and r["inc"] == e["inc"] and r["rec"]["committed"]),
                 None)
    return None if first is None else round(first["rel"] - e["rel"], 2)


def _back(run: ChaosRun, fault: dict[str, Any], g: int) -> dict[str, Any] | None:
    """The event that ended ``fault`` for group ``g``: its restart, its resume, its host's link back."""
    want = {"kill": "launch", "stall": "resume", "partition": "link"}[fault["event"]]
    for e in run.events:
        if e["rel"] < fault["rel"] or e["event"] != want:
            continue
        if want == "launch" and e["group"] == g and e["inc"] != fault["inc"]:
            return e
        if want == "resume" and e["group"] == g:
            return e
        if want == "link" and e["host"] == fault["host"]:
            return e
    return None


def _restart(run: ChaosRun, g: int, inc: int) -> dict[str, Any]:
    """The restarted process: launch → first quorum request (``startup_s``), and its join sync."""
    launch = next((e for e in run.events if e["event"] == "launch" and e["group"] == g and e["inc"] == inc), None)
    first = next((r for r in run.ft if r["group"] == g and r["inc"] == inc and r["rec"]["committed"]), None)
    if launch is None or first is None:
        return {"startup_s": None, "healed": None}
    asked = first["rel"] - first["rec"].get("sync_s", 0.0)
    return {"startup_s": round(asked - launch["rel"], 2), "healed": bool(first["rec"]["healed"])}


def heals(run: ChaosRun, syncs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every heal: the healed group's digest against a non-healed member's in the same sync."""
    out = []
    for s in syncs:
        healed = [r for r in s["rows"] if r["rec"]["healed"]]
        others = {r["rec"]["digest"] for r in s["rows"] if not r["rec"]["healed"]}
        for r in healed:
            out.append({"t": round(r["rel"], 2), "group": r["group"], "inc": r["inc"], "sync": s["sync"],
                        "bit_exact": None if not others else others == {r["rec"]["digest"]}})
    return out


def _losses_after(run: ChaosRun, row: dict[str, Any]) -> list[float]:
    """The training losses of the first ``LOSS_STEPS`` steps of ``row``'s process after its sync
    ``row``: its step records read after it, less the sync step's own (whose forward came before the
    sync; a join sync runs before the process's first step, so nothing is dropped then)."""
    after = [r["loss"] for r in run.steps if r["group"] == row["group"] and r["inc"] == row["inc"]
             and r["i"] > row["i"] and r["loss"] is not None]
    return after[0 if row["rec"]["join"] else 1:][:LOSS_STEPS]


def loss_jumps(run: ChaosRun, syncs: list[dict[str, Any]], bound: float) -> list[dict[str, Any]]:
    """Per heal after the founding sync: the healed group's first steps' training loss against the
    other members' first steps after the same sync (the same θ_global, other batches)."""
    out = []
    for s in syncs:
        for h in (r for r in s["rows"] if r["rec"]["healed"] and s["rel"] > 0):
            after = _losses_after(run, h)
            ref = [x for r in s["rows"] if not r["rec"]["healed"] for x in _losses_after(run, r)]
            if after and ref:
                jump = statistics.fmean(after) - statistics.fmean(ref)
                out.append({"t": round(h["rel"], 2), "group": h["group"], "reference": round(statistics.fmean(ref), 4),
                            "after": round(statistics.fmean(after), 4), "jump": round(jump, 4), "ok": jump <= bound})
    return out


def final_digests(run: ChaosRun) -> dict[str, Any]:
    """At the last sync every surviving group committed: each one's digest, and whether they agree."""
    n = int(run.settings["groups"])
    end = run.duration + 1e9
    last: dict[int, dict[int, str]] = {}
    for g in range(n):
        st = run.state_at(g, end)
        syncs = {r["rec"]["sync"]: r["rec"]["digest"] for r in run.ft
                 if r["group"] == g and r["inc"] == st["inc"] and r["rec"]["committed"]}
        if st["up"] and syncs:  # a process that never rejoined (still starting at the end) has no digest
            last[g] = syncs
    surviving = sorted(last)
    common = set.intersection(*(set(v) for v in last.values())) if last else set()
    if not common:
        return {"surviving": surviving, "sync": None, "digests": {}, "equal": None}
    s = max(common)
    digests = {str(g): last[g][s] for g in surviving}
    return {"surviving": surviving, "sync": s, "digests": digests, "equal": len(set(digests.values())) == 1}


def participation(run: ChaosRun, syncs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per regular committed sync in the window: participants, members, the groups live then."""
    out = []
    for s in syncs:
        if s["join"] or not 0 <= s["rel"] <= run.duration:
            continue
        live = run.live_at(s["rel"])
        out.append({"t": round(s["rel"], 2), "sync": s["sync"], "members": len(s["members"]),
                    "participants": len(s["participants"]), "live": len(live),
                    "ok": len(s["participants"]) >= len(live) - 1})
    return out


def held_out(run: ChaosRun) -> dict[str, Any]:
    """Every surviving group's last held-out loss in the window and their mean, and ``late_mean``:
    the mean of every held-out loss of the window's last ``LATE_S`` seconds (all groups), steadier
    than one evaluation when the loss swings from sync to sync."""
    last: dict[int, float] = {}
    late = []
    for r in run.steps:
        if r.get("eval_loss") is not None and r["rel"] <= run.duration:
            last[r["group"]] = r["eval_loss"]
            if r["rel"] >= run.duration - LATE_S:
                late.append(r["eval_loss"])
    return {"per_group": {str(g): v for g, v in sorted(last.items())},
            "mean": statistics.fmean(last.values()) if last else None, "late_mean": _mean(late)}


def summarize(out: str | Path, loss_bound: float = 0.5) -> dict[str, Any]:
    """The run's ``summary.json`` (module docstring); also writes it and ``summary.md``."""
    run = ChaosRun(out)
    syncs = run.syncs()
    window = [s for s in syncs if 0 <= s["rel"] <= run.duration]
    steps = sum(s["weights"].get(p, 0.0) for s in window for p in s["participants"])
    regular = [s for s in window if not s["join"]]
    gaps = [b["rel"] - a["rel"] for a, b in zip(regular, regular[1:])]
    hl = heals(run, syncs)
    part = participation(run, syncs)
    fl = faults(run)
    summary = {
        "out": str(run.out), "settings": {k: v for k, v in run.settings.items() if k not in ("python", "out")},
        "window_s": run.duration, "committed_syncs": len(regular), "committed_inner_steps": steps,
        "committed_tokens": steps * run.batch_tokens, "goodput_tokens_per_s": steps * run.batch_tokens / run.duration,
        "round_s": statistics.median(gaps) if gaps else None,
        "faults": fl, "faults_injected": sum(1 for f in fl if "skipped" not in f and f["kind"] != "late join"),
        "recovery_s_mean": _mean([f["recovery_s"] for f in fl if f.get("recovery_s") is not None
                                  and f["kind"] != "late join"]),
        "startup_s_mean": _mean([f["startup_s"] for f in fl if f.get("startup_s") is not None]),
        "participation": part, "participation_ok": all(p["ok"] for p in part),
        "participation_mean": _mean([min(1.0, p["participants"] / p["live"]) for p in part if p["live"]]),
        "heals": hl, "heals_bit_exact": sum(1 for h in hl if h["bit_exact"]),
        "heals_checked": sum(1 for h in hl if h["bit_exact"] is not None),
        "final": final_digests(run), "loss_bound": loss_bound, "loss_jumps": loss_jumps(run, syncs, loss_bound),
        "held_out": held_out(run),
    }
    summary["loss_continuous"] = all(j["ok"] for j in summary["loss_jumps"])
    (run.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (run.out / "summary.md").write_text(markdown(summary))
    return summary


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _f(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(s: dict[str, Any]) -> str:
    """``summary.md``: the run's measures in a few lines and its faults in a table."""
    st, fin = s["settings"], s["final"]
    kinds = ",".join(st["kinds"]) if st["rate"] else "no faults"
    lines = [f"# Chaos run: {st['groups']} groups, {st['rate']:g} faults/min ({kinds}), seed {st['seed']}",
             "",
             f"- window {s['window_s']:g} s: {s['committed_syncs']} committed syncs, "
             f"{s['committed_inner_steps']:g} committed inner steps, goodput {s['goodput_tokens_per_s']:.1f} tokens/s",
             f"- participation: mean {_f(s['participation_mean'], '.1%')} of the live groups; every sync >= live - 1: "
             f"{s['participation_ok']}",
             f"- heals bit-exact: {s['heals_bit_exact']} of {s['heals_checked']} checked ({len(s['heals'])} heals)",
             f"- final digests at sync {fin['sync']}: groups {fin['surviving']}, equal: {fin['equal']}",
             f"- loss continuous through every heal (jump <= {s['loss_bound']:g} nat): {s['loss_continuous']}",
             f"- held-out loss: last in the window (mean over groups) {_f(s['held_out']['mean'], '.4f')}, mean of "
             f"the last {LATE_S:g} s {_f(s['held_out']['late_mean'], '.4f')}",
             "", "| t (s) | kind | target | recovery (s) | restart startup (s) | note |", "|---|---|---|---|---|---|"]
    for f in s["faults"]:
        lines.append(f"| {f['t']:.1f} | {f['kind']} | {f['target']} | {_f(f.get('recovery_s'))} | "
                     f"{_f(f.get('startup_s'))} | {f.get('skipped', '')} |")
    return "\n".join(lines) + "\n"
