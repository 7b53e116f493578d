"""What one engine step took: bytes from the communicators' counters, and times from the workers'
timestamps (real backends: measured) or from :func:`gradzip.cluster.schedule.model_step` (sim:
the modelled step built from measured compute and encode/decode times and the modelled link)."""

from __future__ import annotations

from gradzip.cluster.schedule import BucketTiming, Span, mean_timings, measured_spans, model_step
from gradzip.engine.stats import StepStats
from gradzip.engine.worker import _Worker


def step_stats(workers: list[_Worker], n_buckets: int, sim: bool, t_fin: float, t_done: float,
               last_end: float) -> tuple[StepStats, list[BucketTiming], list[Span]]:
    """The step's stats, its per-bucket timings (sim: mean over workers) and its schedule.
    ``t_fin``/``t_done``: when finalize started and ended; ``last_end``: when the last step ended."""
    deltas = [w.comm.stats.since(w.snap) for w in workers]
    sent = round(sum(d["bytes_sent"] for d in deltas) / len(deltas))
    intra = round(sum(d["intra_bytes_sent"] for d in deltas) / len(deltas))
    recv = round(sum(d["bytes_recv"] for d in deltas) / len(deltas))
    if sim:
        per_worker = []
        computes = []
        # A round's link time: the slowest worker's (groups of a split run side by side).
        rounds = [[max(w.exchanges[bi].link_s[r] for w in workers)  # type: ignore[union-attr]
                   for r in range(workers[0].exchanges[bi].rounds)]  # type: ignore[union-attr]
                  for bi in range(n_buckets)]
        for w in workers:
            for bi, t in enumerate(w.timing):
                t.rounds_s = list(rounds[bi])
            per_worker.append(w.timing)
            computes.append(max(0.0, (w.t_end or t_fin) - (w.fwd_start or t_fin) - w.hook_s))
        timings = mean_timings(per_worker)
        m = model_step(sum(computes) / len(computes), timings)
        return (StepStats(compute_s=m.compute_s, compress_s=m.compress_s, comm_s=m.comm_s, bytes_sent=sent,
                          bytes_recv=recv, step_s=m.step_s, clock="modelled", link_s=m.link_s,
                          buckets=n_buckets, intra_bytes_sent=intra), timings, m.spans)
    w = workers[0]
    start = w.fwd_start if w.fwd_start is not None else last_end
    compute = max(0.0, (w.t_end or t_fin) - start - w.hook_s)
    spans = measured_spans(w.marks, start, (w.t_end or t_fin) - start)
    compress = sum(t.compress_s + sum(t.between_s) + t.decode_s for t in w.timing)
    # Exposed communication: time in finalize not spent on engine compute (real backends flush
    # inside finalize, so all of fin_s lies in that interval).
    exposed = max(0.0, (t_done - t_fin) - w.fin_s)
    return (StepStats(compute_s=compute, compress_s=compress, comm_s=exposed, bytes_sent=sent, bytes_recv=recv,
                      step_s=t_done - start, clock=w.comm.clock, link_s=deltas[0]["seconds"],
                      buckets=n_buckets, intra_bytes_sent=intra), list(w.timing), spans)
