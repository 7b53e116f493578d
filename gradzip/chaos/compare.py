"""``gradzip chaos compare RUN...``: chaos runs against their fault-free ones, and against the goodput
model of ``gradzip simulate`` (:mod:`gradzip.cluster.goodput`).

The runs at 0 faults a minute are the baseline: their mean goodput is the denominator of every
``goodput_ratio``, and their held-out losses (each run's mean over its window's last minute:
``held_out.late_mean``) give the seed spread. For every run with faults the
model is asked through ``gradzip simulate --json`` with that run's settings: its replicas (4 groups
= 2 nodes × 2), link rate, compressor (``--sync sparseloco`` for ``ftsparseloco`` runs), H and
``--min-replicas``, and three inputs taken from the
measurement:

- ``--tokens-per-second``: batch tokens × H / the baseline's round (its median time between
  committed syncs), so that the model's round T is the measured one;
- ``--failures-per-minute``: the faults the seed drew in the run's window, per minute (a Poisson
  draw: a 3-minute run at 1 a minute may hold 5), those skipped because their group was not live
  included: the harness, like the model, fails live groups at rate / groups each;
  ``model_goodput_nominal`` is the model at the run's nominal rate;
- ``--recovery``: the restart delay plus the measured ``startup_s`` (a restarted process's launch to
  its first quorum request: interpreter, imports, model build), averaged over every kill of the
  runs compared; the model adds the heal's transfer over the link itself.

The model's failure is a kill. For a run with stalls and partitions the same rate is put in, which
the model does not describe (a stall loses no process; a partition takes a host's groups together).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from gradzip.chaos import figures, report
from gradzip.errors import GradzipError

MODEL_TOLERANCE = 0.15  # |measured − modelled| / modelled


def _summary(run: str | Path) -> dict[str, Any]:
    path = Path(run) / "summary.json"
    if not (Path(run) / "settings.json").exists():
        raise GradzipError(f"{run} is not a chaos run directory (no settings.json): give a gradzip chaos run --out")
    bound = json.loads(path.read_text()).get("loss_bound", 0.5) if path.exists() else 0.5
    return report.summarize(run, bound)  # read again: the summary follows this version's report


def simulate(s: dict[str, Any], faults_per_minute: float, round_s: float, recovery_s: float) -> dict[str, Any]:
    """``gradzip simulate --json``'s row for a run of settings ``s`` (module docstring)."""
    hosts = max(int(s["hosts"]), 1)
    tps = s["batch_size"] * s["seq_len"] * s["every"] / round_s
    argv = ["--model", s["model"], "--nodes", str(hosts), "--gpus-per-node", str(s["groups"] // hosts),
            "--inter-bandwidth", s["link_rate"], "--link-efficiency", "0.956", "--tokens-per-second", f"{tps:.3f}",
            "--batch-size", str(s["batch_size"]), "--seq-len", str(s["seq_len"]),
            *(["--sync", f"sparseloco:every={s['every']}"] if s.get("mode") == "ftsparseloco" else
              ["--compressor", s["compressor"], "--sync", f"diloco:every={s['every']}"]),
            "--json", "--failures-per-minute", f"{faults_per_minute:g}",
            "--recovery", f"{recovery_s:.2f}s", "--min-replicas", str(s["min_replicas"])]
    if faults_per_minute == 0:  # the fault-free run is the model's unit
        return {"command": None, "goodput": 1.0, "participation": 1.0, "round_s": round_s, "absent_s": None}
    p = subprocess.run([sys.executable, "-m", "gradzip", "simulate", *argv], capture_output=True, text=True,
                       timeout=120)
    if p.returncode != 0:
        raise GradzipError(f"gradzip simulate failed: {p.stderr.strip().splitlines()[-1:]}")
    row = json.loads(p.stdout)["results"][0]
    return {"command": "gradzip simulate " + " ".join(argv), "goodput": row["goodput"],
            "participation": row["participation"], "round_s": row["round_s"],
            "absent_s": row.get("absent_s")}


def compare(runs: list[str], out: str | Path) -> dict[str, Any]:
    """Every run's verdicts against the baseline and the model; writes ``compare.json``,
    ``compare.md`` and the figures into ``out``."""
    sums = [_summary(r) for r in runs]
    modes = sorted({s["settings"].get("mode", "ftdiloco") for s in sums})
    if len(modes) > 1:
        raise GradzipError(f"the runs mix --mode {' and '.join(modes)}: compare the runs of one mode at a time "
                           "(each against its own fault-free runs)")
    base = [s for s in sums if s["settings"]["rate"] == 0]
    if not base:
        raise GradzipError("gradzip chaos compare needs at least one run at --faults-per-minute 0 (the baseline)")
    base_goodput = statistics.fmean(s["goodput_tokens_per_s"] for s in base)
    losses = [s["held_out"]["late_mean"] for s in base if s["held_out"]["late_mean"] is not None]
    spread = (min(losses), max(losses)) if losses else None
    rounds = [s["round_s"] for s in base if s["round_s"]]
    round_s = statistics.median(rounds)
    startups = [f["startup_s"] for s in sums for f in s["faults"] if f.get("startup_s") is not None]
    startup = statistics.fmean(startups) if startups else 0.0
    rows = []
    cache: dict[tuple[Any, ...], dict[str, Any]] = {}

    def ask(st: dict[str, Any], rate: float, round_s: float, recovery: float) -> dict[str, Any]:
        key = (json.dumps(st, sort_keys=True), round(rate, 6), round_s, recovery)
        if key not in cache:
            cache[key] = simulate(st, rate, round_s, recovery)
        return cache[key]

    for s in sums:
        st = s["settings"]
        drawn = sum(1 for f in s["faults"] if f["kind"] != "late join")  # skipped ones included
        realized = drawn * 60.0 / s["window_s"] if st["rate"] else 0.0
        model = ask(st, realized, round_s, st["recovery"] + startup)
        nominal = ask(st, st["rate"], round_s, st["recovery"] + startup)
        ratio = s["goodput_tokens_per_s"] / base_goodput
        loss = s["held_out"]["late_mean"]
        rows.append({
            "run": s["out"], "rate": st["rate"], "kinds": st["kinds"], "faults": s["faults_injected"],
            "goodput_tokens_per_s": s["goodput_tokens_per_s"], "goodput_ratio": ratio,
            "faults_per_minute_realized": realized, "model_goodput": model["goodput"],
            "model_goodput_nominal": nominal["goodput"],
            "model_error": abs(ratio - model["goodput"]) / model["goodput"],
            "model_command": model["command"], "participation_ok": s["participation_ok"],
            "participation_mean": s["participation_mean"], "heals": len(s["heals"]),
            "heals_bit_exact": s["heals_bit_exact"], "heals_checked": s["heals_checked"],
            "final_equal": s["final"]["equal"], "loss_continuous": s["loss_continuous"], "held_out": loss,
            "loss_in_spread": None if loss is None or spread is None else spread[0] <= loss <= spread[1],
            "recovery_s_mean": s["recovery_s_mean"]})
    res = {"baseline_goodput_tokens_per_s": base_goodput, "baseline_loss_spread": spread, "round_s": round_s,
           "startup_s": startup, "model_tolerance": MODEL_TOLERANCE, "runs": rows}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "compare.md").write_text(table(res) + "\n")
    res["figures"] = figures.draw([report.ChaosRun(r) for r in runs], res, out)
    return res


def table(res: dict[str, Any]) -> str:
    """The comparison as a Markdown table, one row a run."""
    lines = [f"Baseline goodput {res['baseline_goodput_tokens_per_s']:.1f} tokens/s (mean of the fault-free runs); "
             f"round {res['round_s']:.1f} s; restart startup {res['startup_s']:.1f} s; held-out loss spread of the "
             f"fault-free runs {_spread(res['baseline_loss_spread'])}.", "",
             "| run | faults/min | kinds | faults | goodput (tok/s) | vs fault-free | model (nominal rate) | "
             "model error | participants >= live-1 | heals bit-exact | final digests equal | loss continuous | "
             "held-out loss (last 60 s) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        lines.append(
            f"| {Path(r['run']).name} | {r['rate']:g} | {','.join(r['kinds']) if r['rate'] else '-'} | {r['faults']} | "
            f"{r['goodput_tokens_per_s']:.1f} | {r['goodput_ratio']:.1%} | {r['model_goodput']:.1%} "
            f"({r['model_goodput_nominal']:.1%}) | "
            f"{r['model_error']:.1%} | {r['participation_ok']} | {r['heals_bit_exact']}/{r['heals_checked']} | "
            f"{r['final_equal']} | {r['loss_continuous']} | {_f(r['held_out'])} |")
    return "\n".join(lines)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _spread(sp: Any) -> str:
    return "-" if not sp else f"{sp[0]:.4f} to {sp[1]:.4f}"
