"""The downstream section of ``results.md``: each configuration's fine-tuned accuracy with its 95%
interval, and its paired difference from ``none``.

A sweep with a ``[downstream]`` table fine-tunes every cell's model with fine-tuning seeds 0, 1, ...
(:mod:`gradzip.experiments.downstream`). A fine-tuning run is identified by its pretraining seed and
its fine-tuning seed; the fine-tuning seed fixes the classifier's initialisation and the data
order, so runs of two configurations with the same pair of seeds are paired. Per configuration:

- accuracy: the mean over every fine-tuning run, with the two-sided 95% t interval over them;
- Δ vs none: accuracy minus that of the ``none`` configuration (otherwise equal parameters) for
  each pair of seeds both have, with the mean's 95% t interval
  (:class:`gradzip.plots.paired.Paired`); the verdict reads higher accuracy as better.
"""

from __future__ import annotations

from gradzip.plots.downstream import load_downstream
from gradzip.plots.lowcomm import Config, configurations
from gradzip.plots.paired import Paired, interval_text, signed
from gradzip.plots.results import Collection, _hashable


def _accuracies(c: Config) -> dict[tuple[str, int], float]:
    """(pretraining seed, fine-tuning seed) -> validation accuracy, over the configuration's runs."""
    out: dict[tuple[str, int], float] = {}
    for r in c.runs:
        doc = load_downstream(r)
        for s in (doc or {}).get("seeds", []):
            if isinstance(s.get("accuracy"), (int, float)) and isinstance(s.get("seed"), int):
                out[(str(r.value("seed")), s["seed"])] = float(s["accuracy"])
    return out


def _spread(values: list[float]) -> Paired:
    """The values themselves as a :class:`Paired` (its mean and t interval are the values')."""
    return Paired(list(enumerate(values)))


def downstream_markdown(col: Collection) -> str:
    """The section (empty when no run has downstream results)."""
    configs = [(c, acc) for c in configurations(col) if (acc := _accuracies(c))]
    if not configs:
        return ""
    others = [k for k in col.varying() if k not in ("seed", "compressor")]
    lines = ["", "## Downstream", "",
             "| configuration | fine-tuning runs | accuracy [95% CI] | Δ vs none per run | Δ vs none [95% CI] "
             "| verdict |",
             "|---|---:|---:|---:|---:|---|"]
    for c, acc in configs:
        base = next((a for b, a in configs if b.runs[0].compressor_family == "none"
                     and all(_hashable(b.runs[0].value(k)) == _hashable(c.runs[0].value(k)) for k in others)), None)
        mean = _spread(list(acc.values()))
        acc_text = (f"{mean.mean:.4f} [{mean.lo:.4f}, {mean.hi:.4f}]" if mean.lo is not None and mean.hi is not None
                    else f"{mean.mean:.4f}")
        if c.runs[0].compressor_family == "none" or base is None:
            delta = per_run = verdict = "baseline" if base is not None else "—"
        else:
            keys = sorted(acc.keys() & base.keys())
            paired = Paired([(i, acc[k] - base[k]) for i, k in enumerate(keys)])
            per_run = ", ".join(signed(d) for _, d in paired.diffs) or "—"
            delta = interval_text(paired)
            # higher accuracy is better: the loss rule's words swap
            verdict = {"worse": "better", "better": "worse"}.get(paired.verdict, paired.verdict)
        lines.append(f"| {c.label} | {len(acc)} | {acc_text} | {per_run} | {delta} | {verdict} |")
    lines += ["", "Downstream: validation accuracy of the fine-tuned classifier (each cell's downstream/summary.json). "
              "A fine-tuning run is a pair (pretraining seed, fine-tuning seed); accuracy [95% CI] is the mean over "
              "the configuration's runs with the two-sided 95% t interval; Δ vs none pairs runs with the same two "
              "seeds. verdict: better when the interval of Δ lies above 0 (higher accuracy), worse when below, "
              "else within noise."]
    return "\n".join(lines) + "\n"
