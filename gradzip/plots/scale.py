"""Figures of how exchange schemes scale with the number of workers (``bytes_workers``,
``throughput_workers``; registered in :data:`gradzip.plots.figures.DRAW`).

A *method* is what a run exchanges and how: the compressor (its spec without ``exchange=``), the
exchange scheme (``allreduce``, ``allgather``, ``twophase``, ``sparse``: from ``summary.json``,
else the spec's ``exchange=`` or the ``exchange`` key) and whether it is hierarchical (with its
ranks per node). Runs of one method at different worker counts make one line; any other
parameter that varies (besides workers, steps, seed and the optimizer's) is added to the label,
and seeds are averaged (error bars: min–max).

Colour is the compressor, the marker the scheme; hierarchical methods are dash-dotted with open
markers, so a dashed line is always a reference line.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from matplotlib.ticker import FuncFormatter, NullLocator

from gradzip.plots import style
from gradzip.plots.captions import clock_caption, clock_of, fixed_caption, fmt_value
from gradzip.plots.grouping import Skip, by
from gradzip.plots.results import NOT_BYTES_KEYS, Collection, LossTarget, Run

SCHEME_MARKERS = {"allreduce": "o", "allgather": "s", "twophase": "^", "sparse": "D"}
# Varying keys that never split a line: the x axis, run length, and what changes no byte or second.
_ACROSS = {"workers", "steps", "seed", "lr", "warmup", "clip", "weight_decay", "compressor", "exchange",
           "hierarchical", "ranks_per_node"}


def split_compressor(spec: str) -> tuple[str, str | None]:
    """``("topk:ratio=0.01,ef=true", "sparse")`` from ``"topk:ratio=0.01,ef=true,exchange=sparse"``:
    the spec without its ``exchange=`` parameter, and that parameter (None when absent)."""
    name, _, rest = spec.partition(":")
    params = [p for p in rest.split(",") if p.strip()] if rest else []
    scheme = None
    kept = []
    for p in params:
        key, _, value = p.partition("=")
        if key.strip().lower() == "exchange":
            scheme = value.strip().lower()
        else:
            kept.append(p.strip())
    return name.strip() + (":" + ",".join(kept) if kept else ""), scheme


def scheme_of(run: Run) -> str | None:
    """The run's exchange scheme: the one it ran (``summary.json``), else the one it asked for."""
    s = (run.summary or {}).get("exchange")
    if s:
        return str(s)
    spelled = split_compressor(run.compressor)[1]
    if spelled:
        return spelled
    v = run.value("exchange")
    return str(v) if v else None


def is_hierarchical(run: Run) -> bool:
    """Whether the run reduced inside nodes first (its config's ``hierarchical``, else its summary's)."""
    v = run.value("hierarchical")
    if v is None:
        v = (run.summary or {}).get("hierarchical")
    return v is True or str(v).lower() == "true"


def inter_bytes_per_step(run: Run) -> float | None:
    """Bytes per rank per step that crossed between nodes (``summary.json``'s
    ``inter_bytes_per_step``, else the mean of ``bytes_inter``; runs from before that count: all of
    ``bytes_per_step``)."""
    v = (run.summary or {}).get("inter_bytes_per_step")
    if v is not None:
        return float(v)
    rows = [m for m in run.train_rows if m.get("bytes_inter") is not None]
    if rows:
        return sum(float(m["bytes_inter"]) for m in rows) / len(rows)
    return run.bytes_per_step


@dataclass
class Method:
    """The runs of one compressor × scheme × (flat | hierarchical), at any number of workers."""

    label: str
    compressor: str  # the spec without exchange=: picks the colour
    scheme: str | None
    hierarchical: bool
    runs: list[Run] = field(default_factory=list)

    def style(self, pal: style.Palette) -> dict[str, Any]:
        """Keyword arguments of ``ax.plot``/``ax.errorbar`` for this method's line."""
        kw: dict[str, Any] = {"color": pal.color(self.compressor), "linestyle": "-",
                              "marker": SCHEME_MARKERS.get(self.scheme or "", "v")}
        if self.hierarchical:
            kw.update(linestyle="-.", markerfacecolor="white", markeredgewidth=1.2)
        return kw


def methods(col: Collection, exclude: set[str] = frozenset()) -> list[Method]:
    """Group the runs into methods (see the module doc), in the runs' order; keys in ``exclude``
    do not split a method either."""
    others = [k for k in col.varying() if k not in _ACROSS and k not in exclude]
    out: dict[tuple, Method] = {}
    for r in col.runs:
        comp, _ = split_compressor(r.compressor)
        scheme, hier = scheme_of(r), is_hierarchical(r)
        per_node = r.value("ranks_per_node") if hier else None
        extra = ", ".join(f"{k}={fmt_value(r.value(k))}" for k in others)
        key = (comp, scheme, hier, str(per_node), extra)
        if key not in out:
            label = " · ".join(t for t in (comp, scheme, ("hierarchical" + (f" ({per_node}/node)" if per_node else ""))
                                               if hier else "", extra) if t)
            out[key] = Method(label, comp, scheme, hier)
        out[key].runs.append(r)
    return list(out.values())


def _workers_axis(ax, ns: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.xaxis.set_minor_locator(NullLocator())


def _plot_points(ax, m: Method, pts: dict[float, tuple[float, float, float]], pal: style.Palette,
                 scale: float = 1.0, label: str | None = None) -> None:
    xs = list(pts)
    ys = [pts[x][0] / scale for x in xs]
    kw = m.style(pal)
    if any(len([r for r in m.runs if r.workers == x]) > 1 for x in xs):
        err = [[(pts[x][0] - pts[x][1]) / scale for x in xs], [(pts[x][2] - pts[x][0]) / scale for x in xs]]
        ax.errorbar(xs, ys, yerr=err, capsize=2, label=label, **kw)
    else:
        ax.plot(xs, ys, label=label, **kw)


def payloads(ms: list[Method]) -> dict[str, float]:
    """Compressor -> its payload: the bytes one rank contributes per step, its compressed tensors
    (``c``) plus the small tensors the engine sends in full precision (``a``, below
    ``min_compress_numel``). From the compressor's flat ``allgather`` runs, whose bytes per rank are
    ``(n − 1)·c + 2(n − 1)/n·a`` (ring allgather of the payloads, ring allreduce of the small
    tensors): least squares over two or more worker counts, else bytes / (n − 1)."""
    acc: dict[str, list[tuple[int, float]]] = {}
    for m in ms:
        if m.scheme != "allgather" or m.hierarchical:
            continue
        for r in m.runs:
            if r.workers >= 2 and r.bytes_per_step:
                acc.setdefault(m.compressor, []).append((r.workers, r.bytes_per_step))
    out: dict[str, float] = {}
    for comp, pts in acc.items():
        if len({n for n, _ in pts}) >= 2:
            a = np.array([[n - 1, 2 * (n - 1) / n] for n, _ in pts], dtype=float)
            (c, small), *_ = np.linalg.lstsq(a, np.array([b for _, b in pts]), rcond=None)
            out[comp] = float(c + small)
        else:
            out[comp] = statistics.median(b / (n - 1) for n, b in pts)
    return out


def _ratio_text(m: Method, pts: dict[float, tuple[float, float, float]], payload: float, where: str) -> str:
    lo, hi = min(pts), max(pts)
    return f"{m.label}{where} {pts[lo][0] / payload:.3g}× at n={lo:g} → {pts[hi][0] / payload:.3g}× at n={hi:g}"


def fig_bytes_workers(col: Collection, pal: style.Palette, target: LossTarget | None = None):
    """Bytes sent per rank per step against workers, log-log, one line per method; a second panel
    with the bytes that crossed nodes when some runs keep traffic inside nodes."""
    ns = sorted({r.workers for r in col.runs if r.bytes_per_step is not None})
    if len(ns) < 2:
        raise Skip("the runs have only one worker count")
    ms = methods(col, NOT_BYTES_KEYS)
    pay = payloads(ms)
    two = any(abs((inter_bytes_per_step(r) or 0.0) - (r.bytes_per_step or 0.0)) > 0.5 for r in col.runs)
    fig, axes = style.new_figure(ncols=2 if two else 1, width=11.0 if two else 7.6, height=4.4, sharey=True)
    panels = [("sent per rank, all links", lambda r: r.bytes_per_step)]
    if two:
        panels.append(("crossing nodes per rank", inter_bytes_per_step))
    ratios: list[str] = []
    zeros: dict[float, list[str]] = {}  # workers -> methods that send nothing across nodes there
    for i, (ax, (title, value)) in enumerate(zip(axes, panels)):
        for m in ms:
            pts = by(m.runs, lambda r: r.workers, value)
            if i == 1:
                for x in (x for x, v in pts.items() if v[0] <= 0):
                    zeros.setdefault(x, []).append(m.label)
            pts = {x: v for x, v in pts.items() if v[0] > 0}  # a log axis has no 0
            if not pts:
                continue
            _plot_points(ax, m, pts, pal, 1e6, m.label)
            # hierarchical methods in payloads of what crosses nodes: their intra-node traffic is not compressed
            if m.compressor in pay and i == (1 if two and m.hierarchical else 0):
                ratios.append(_ratio_text(m, pts, pay[m.compressor], " across nodes" if two and m.hierarchical else ""))
        for comp, b in pay.items():
            ax.axhline(b / 1e6, color=pal.color(comp), linestyle="--", linewidth=0.9, alpha=0.8,
                       label=f"payload of {comp}")
        _workers_axis(ax, ns)
        style.log_y(ax)
        if two:
            ax.set_title(title)
        ax.set_xlabel("workers (count, log scale)")
    axes[0].set_ylabel("MB per rank per step (log scale)")
    if not two:
        axes[0].set_title("Bytes on the wire against workers")
    axes[-1].legend(*axes[0].get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(1.01, 1.0),
                    fontsize=style.RC["legend.fontsize"], frameon=False)
    caption = ("Megabytes (10^6 bytes) each rank sends per optimizer step against the number of workers, "
               "log-log, one line per compressor and exchange scheme (marker: the scheme; dash-dotted with open "
               "markers: hierarchical), counted with the collective algorithms' formulas (ring allreduce and "
               "allgather, pairwise alltoall). Dashed lines: each compressor's payload, what one rank contributes "
               "per step (its compressed tensors plus the small tensors sent in full precision, fitted to its "
               "allgather runs), which every scheme sends about once at n=2. ")
    if ratios:
        caption += "Bytes per rank in payloads: " + "; ".join(ratios) + ". "
    if two:
        caption += ("Left: everything a rank sends, including the full-precision traffic inside a node of the "
                    "hierarchical methods; right: only what crosses between nodes (the same for flat methods, "
                    "whose ranks each have a node of their own). ")
        for x, labels in zeros.items():
            hier = [m.label for m in ms if m.hierarchical and any(r.workers == x for r in m.runs)]
            who = "every hierarchical method" if labels == hier else ", ".join(labels)
            caption += f"Nothing crosses nodes for {who} at n={x:g} (one node): not drawn on the log axis. "
    caption += fixed_caption(col, NOT_BYTES_KEYS | {"workers", "steps"})
    return fig, " ".join(caption.split())


# What one worker computes: runs equal in these keys measure the same forward + backward pass.
COMPUTE_KEYS = ("model", "batch_size", "accumulation", "seq_len", "precision", "device", "vocab_size")


def _compute_group(run: Run) -> tuple[str, ...]:
    return tuple(str(run.value(k)) for k in COMPUTE_KEYS)


def reference_compute(col: Collection) -> dict[tuple[str, ...], float]:
    """Per group of runs that compute the same thing (:data:`COMPUTE_KEYS`): the least mean compute
    time per step of its runs (first step excluded), the best estimate of an unloaded machine's, as
    load only ever slows a measurement down."""
    out: dict[tuple[str, ...], float] = {}
    for r in col.runs:
        c = r.phase_means()["compute"] if r.train_rows else 0.0
        if c > 0:
            g = _compute_group(r)
            out[g] = min(out.get(g, c), c)
    return out


def normalised_samples_per_s(run: Run, ref: dict[tuple[str, ...], float]) -> float | None:
    """Global samples/s of ``run`` on the sim's clock with the reference compute time of its group:
    step = c_ref · (1 + (compress + optimizer) / compute) + communication, from the run's mean phase
    times (first step excluded). Compression and the optimizer are scaled by the run's own load
    factor compute / c_ref; communication is modelled and kept as it is. Assumes that the exposed
    communication does not depend on the compute speed (true when the gradient is one bucket; with
    several, a faster backward hides less, and the estimate is optimistic). None without phases."""
    c_ref = ref.get(_compute_group(run))
    p = run.phase_means() if run.train_rows else None
    if not c_ref or not p or p["compute"] <= 0:
        return None
    step = c_ref * (1 + (p["compress"] + p["opt"]) / p["compute"]) + p["comm"]
    per_step = int(run.config.get("batch_size", 1)) * int(run.config.get("accumulation", 1)) * run.workers
    return per_step / step


def free_throughput(col: Collection, ref: dict[tuple[str, ...], float] | None = None) -> float | None:
    """Samples/s of one worker that neither communicates nor compresses: its batch over compute +
    optimizer time per step, the median over runs (with ``ref``: the reference compute time plus the
    median optimizer/compute ratio, so the load does not count)."""
    phases = [r.phase_means() for r in col.runs if r.train_rows]
    phases = [q for q in phases if q["compute"] > 0]
    if not phases:
        return None
    if ref and len(ref) == 1:
        t = next(iter(ref.values())) * (1 + statistics.median(q["opt"] / q["compute"] for q in phases))
    else:
        t = statistics.median(q["compute"] + q["opt"] for q in phases)
    r0 = col.runs[0]
    return int(r0.config.get("batch_size", 1)) * int(r0.config.get("accumulation", 1)) / t


def fig_throughput_workers(col: Collection, pal: style.Palette, target: LossTarget | None = None):
    """Global samples/s against workers, one line per method, with the communication-free bound
    n × :func:`free_throughput` dashed. On the sim's clock the lines are load-normalised
    (:func:`normalised_samples_per_s`) and each run's own samples/s is drawn faintly beside them; on a
    measured clock they are the runs' samples/s."""
    ns = sorted({r.workers for r in col.runs if r.samples_per_s})
    if len(ns) < 2:
        raise Skip("the runs have only one worker count")
    ms = methods(col, {"bandwidth", "latency"} if len({r.bandwidth_bps for r in col.runs}) == 1 else set())
    clock = clock_of(col.runs)
    ref = reference_compute(col) if clock == "modelled" else {}
    norm = bool(ref) and all(normalised_samples_per_s(r, ref) for r in col.runs if r.samples_per_s)
    fig, (ax,) = style.new_figure(width=7.6, height=4.4)
    last: list[tuple[float, str]] = []
    ys_all: list[float] = []
    for m in ms:
        value = (lambda r: normalised_samples_per_s(r, ref)) if norm else (lambda r: r.samples_per_s)
        pts = by(m.runs, lambda r: r.workers, value)
        if not pts:
            continue
        _plot_points(ax, m, pts, pal, 1.0, m.label)
        ys_all += [v[0] for v in pts.values()]
        if norm:
            raw = by(m.runs, lambda r: r.workers, lambda r: r.samples_per_s)
            ax.plot(list(raw), [v[0] for v in raw.values()], linestyle="none", marker=m.style(pal)["marker"],
                    color=pal.color(m.compressor), alpha=0.3, markersize=3.5)
            ys_all += [v[0] for v in raw.values()]
        if max(pts) == ns[-1]:
            last.append((pts[ns[-1]][0], m.label))
    free = free_throughput(col, ref if norm else None)
    if free:
        ax.plot(ns, [n * free for n in ns], color="0.4", linestyle="--", linewidth=0.9,
                label="no communication, no compression")
        ys_all += [n * free for n in ns]
    if norm:
        ax.plot([], [], linestyle="none", marker="o", color="0.5", alpha=0.3, markersize=3.5,
                label="each run's own clock (faint)")
    _workers_axis(ax, ns)
    if ys_all and max(ys_all) > 3 * min(ys_all):
        style.log_y(ax)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:,.0f}"))
    ax.set_xlabel("workers (count, log scale)")
    ax.set_ylabel(f"throughput (samples/s, {clock}{', load-normalised' if norm else ''})")
    ax.set_title("Throughput against workers")
    style.legend(ax, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    caption = ("Global training throughput (samples per second, all workers, first step excluded) against the "
               "number of workers, one line per compressor and exchange scheme (marker: the scheme; dash-dotted "
               "with open markers: hierarchical). ")
    if norm:
        computes = [r.phase_means()["compute"] * 1e3 for r in col.runs if r.train_rows]
        caption += ("Lines: load-normalised, every run timed with one reference compute time per step (the least "
                    f"measured in any run, {min(ref.values()) * 1e3:.0f} ms), its own compression and optimizer "
                    "times scaled by the same factor and its communication as modelled; faint markers: each run's "
                    "samples/s on its own clock, as in the results table. The measured compute time per step "
                    f"ranged {min(computes):.0f}–{max(computes):.0f} ms between runs: the machine's load, not the "
                    "method. ")
    if free:
        caption += ("Dashed line: what n workers would reach if communication and compression were free (one "
                    "worker's batch over its compute + optimizer time per step). ")
    if last:
        ranked = sorted(last, reverse=True)
        caption += f"At {ns[-1]} workers: " + ", ".join(f"{lab} {v:,.0f}" for v, lab in ranked)
        caption += (f" (bound {ns[-1] * free:,.0f})" if free else "") + ". "
    caption += ("Compute and compression are measured in every run, so close points are within timing noise. "
                + clock_caption(col.runs) + " " + fixed_caption(col, {"workers", "steps"}))
    return fig, " ".join(caption.split())

