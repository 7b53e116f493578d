"""The figures of ``gradzip chaos compare``: goodput against the fault rate (measured and
modelled), participation per sync, and held-out loss against time with the faults marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradzip.chaos import report

KIND_COLOURS = {"kill": "tab:red", "stall": "tab:orange", "partition": "tab:purple"}


def _plt() -> Any:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def draw(runs: list[report.ChaosRun], res: dict[str, Any], out: Path) -> list[str]:
    """Writes the three figures into ``out``; returns their paths."""
    return [goodput(res, out / "goodput.png"), participation(runs, out / "participation.png"),
            loss(runs, out / "loss.png")]


def goodput(res: dict[str, Any], path: Path) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    rows = sorted(res["runs"], key=lambda r: r["rate"])
    kills = [r for r in rows if r["rate"] == 0 or list(r["kinds"]) == ["kill"]]
    mixed = [r for r in rows if r["rate"] > 0 and list(r["kinds"]) != ["kill"]]
    for pts, marker, label in ((kills, "o", "measured (kills)"), (mixed, "s", "measured (kills, stalls, partitions)")):
        if pts:
            ax.plot([r["rate"] for r in pts], [r["goodput_ratio"] for r in pts], marker, label=label)
    model = sorted({(r["rate"], r["model_goodput_nominal"]) for r in rows})
    ax.plot([m[0] for m in model], [m[1] for m in model], "k--", label="model at the nominal rate")
    real = [r for r in rows if r["rate"] > 0]
    ax.plot([r["faults_per_minute_realized"] for r in real], [r["model_goodput"] for r in real], "kx",
            label="model at the injected rate")
    ax.plot([r["faults_per_minute_realized"] for r in real], [r["goodput_ratio"] for r in real], "+", color="0.4",
            label="measured, at the injected rate")
    ax.set_xlabel("faults per minute (whole run)")
    ax.set_ylabel("committed tokens/s vs fault-free")
    ax.set_ylim(0, 1.15)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def participation(runs: list[report.ChaosRun], path: Path) -> str:
    plt = _plt()
    faulty = [r for r in runs if r.settings["rate"] > 0] or runs
    fig, axes = plt.subplots(len(faulty), 1, figsize=(7, 1.9 * len(faulty)), sharex=True, squeeze=False)
    for ax, run in zip(axes[:, 0], faulty):
        part = report.participation(run, run.syncs())
        ax.step([p["t"] for p in part], [p["live"] for p in part], where="post", color="0.6", label="live groups")
        ax.plot([p["t"] for p in part], [p["participants"] for p in part], "o", ms=3, label="participants")
        _mark_faults(ax, run)
        ax.set_ylim(-0.2, int(run.settings["groups"]) + 0.5)
        ax.set_ylabel("groups")
        ax.set_title(f"{run.out.name}: {run.settings['rate']:g} faults/min", fontsize=9)
    axes[0, 0].legend(fontsize=7, loc="lower left")
    axes[-1, 0].set_xlabel("seconds from the founding sync")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def loss(runs: list[report.ChaosRun], path: Path) -> str:
    plt = _plt()
    fig, axes = plt.subplots(len(runs), 1, figsize=(7, 1.9 * len(runs)), sharex=True, sharey=True, squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        ev = [r for r in run.steps if r.get("eval_loss") is not None and r["rel"] <= run.duration]
        ax.plot([r["rel"] for r in ev], [r["eval_loss"] for r in ev], ".", ms=4)
        _mark_faults(ax, run)
        ax.set_ylabel("held-out loss")
        ax.set_title(f"{run.out.name}: {run.settings['rate']:g} faults/min", fontsize=9)
    axes[-1, 0].set_xlabel("seconds from the founding sync")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def _mark_faults(ax: Any, run: report.ChaosRun) -> None:
    for e in run.events:
        if e["event"] in KIND_COLOURS:
            ax.axvline(e["rel"], color=KIND_COLOURS[e["event"]], lw=0.8, alpha=0.7)
