"""The control plane's latency during a chaos run on the testbed (``gradzip chaos run
--probe-control``) and its table (``gradzip chaos control-plane RUN... --out DIR``).

The probe (``python -m gradzip.chaos.control``, started by the harness in the last host's
namespace, the far side of the link from the Lighthouse) every ``--interval`` seconds reads the
htb backlog of every host's egress (``tc -s``: bytes queued, what a packet of the data class waits
behind), then times one request to the Lighthouse's port: a TCP connect, an HTTP ``GET /status``
padded to the size of a quorum request, its reply (the size of a quorum reply) read to the end.
The reply is the Lighthouse's own view of the heartbeats (``NAME: seen X s ago``): each sample
records the oldest. One JSON line per sample in ``control_probe.jsonl``: ``t`` (monotonic s),
``rtt_ms`` (null: no reply within ``--timeout``), ``backlog`` (bytes per host), ``hb_age_ms``."""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gradzip.errors import GradzipError
from gradzip.netem.iproute import HOST_IF, tool

PROBE_FILE = "control_probe.jsonl"
BUSY_BYTES = 64_000  # a sample is "during an exchange" when some host has this much queued
PAD = 300  # bytes of header padding: the request is the size of a quorum request (> the ACK class's 128)
_SEEN = re.compile(rb":\s*seen\s+([0-9.eE+-]+)s ago")


def backlog(ns: str) -> int:
    """Bytes queued in the root qdisc of ``ns``'s egress (0 if tc does not say)."""
    p = subprocess.run([tool("tc"), "-n", ns, "-s", "-j", "qdisc", "show", "dev", HOST_IF], capture_output=True,
                       text=True, check=False)
    try:
        qdiscs = json.loads(p.stdout or "[]")
    except ValueError:
        return 0
    return sum(int(q.get("backlog", 0)) for q in qdiscs if q.get("root"))


def heartbeat_age_ms(reply: bytes) -> float | None:
    """The oldest heartbeat the Lighthouse's status page lists, in ms (None: it lists none)."""
    ages = [float(m) for m in _SEEN.findall(reply)]
    return max(ages) * 1e3 if ages else None


def request(host: str, port: int, timeout: float) -> tuple[float | None, bytes]:
    """One timed connect + ``GET /status`` + reply read to its end: (ms or None on failure, reply)."""
    t = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=timeout) as c:
            c.settimeout(max(0.01, timeout - (time.perf_counter() - t)))
            c.sendall(f"GET /status HTTP/1.1\r\nHost: {host}\r\nX-Pad: {'p' * PAD}\r\nConnection: close\r\n\r\n"
                      .encode())
            chunks = []
            while chunk := c.recv(65536):
                chunks.append(chunk)
    except OSError:
        return None, b""
    return (time.perf_counter() - t) * 1e3, b"".join(chunks)


def probe(host: str, port: int, namespaces: list[str], out: Path, interval: float, timeout: float,
          stop: threading.Event) -> None:
    """Samples until ``stop`` (module docstring), one line each appended to ``out``."""
    with out.open("a", encoding="utf-8") as f:
        while not stop.is_set():
            t = time.monotonic()
            queued = [backlog(ns) for ns in namespaces]
            rtt, reply = request(host, port, timeout)
            f.write(json.dumps({"t": round(t, 4), "rtt_ms": None if rtt is None else round(rtt, 3),
                                "backlog": queued, "hb_age_ms": heartbeat_age_ms(reply)}) + "\n")
            f.flush()
            stop.wait(max(0.0, interval - (time.monotonic() - t)))


def _stats(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0, "median": None, "p90": None, "max": None}
    xs = sorted(xs)
    return {"n": len(xs), "median": round(statistics.median(xs), 2),
            "p90": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 2), "max": round(xs[-1], 2)}


def summarize(samples: list[dict[str, Any]], busy_bytes: int = BUSY_BYTES) -> dict[str, Any]:
    """Control RTT (ms) of the samples taken while no host had anything queued (``idle``) and
    while some host had ``busy_bytes`` or more queued (``loaded``: during an exchange), the
    failed requests in each, the Lighthouse's oldest heartbeat age (ms) over every sample, and the
    largest backlog seen (bytes)."""
    idle = [s for s in samples if max(s["backlog"], default=0) == 0]
    loaded = [s for s in samples if max(s["backlog"], default=0) >= busy_bytes]
    ages = [s["hb_age_ms"] for s in samples if s.get("hb_age_ms") is not None]
    return {
        "samples": len(samples), "busy_bytes": busy_bytes,
        "idle_rtt_ms": _stats([s["rtt_ms"] for s in idle if s["rtt_ms"] is not None]),
        "loaded_rtt_ms": _stats([s["rtt_ms"] for s in loaded if s["rtt_ms"] is not None]),
        "idle_failed": sum(s["rtt_ms"] is None for s in idle),
        "loaded_failed": sum(s["rtt_ms"] is None for s in loaded),
        "heartbeat_age_ms": _stats(ages),
        "max_backlog_bytes": max((max(s["backlog"], default=0) for s in samples), default=0),
    }


def read_samples(path: Path) -> list[dict[str, Any]]:
    """The probe's lines (a torn last line, from a probe ended mid-write, is left out)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def report(runs: list[str], out: str) -> dict[str, Any]:
    """``control_plane.json`` and ``.md`` in ``out``: per run (each made with ``--probe-control``)
    its link, whether control traffic had priority, :func:`summarize`, and its syncs' participation."""
    rows = []
    for r in map(Path, runs):
        probe_file = r / PROBE_FILE
        if not probe_file.is_file():
            raise GradzipError(f"{r} has no {PROBE_FILE}: give runs made with `gradzip chaos run --probe-control`")
        settings = json.loads((r / "settings.json").read_text(encoding="utf-8"))
        summary_file = r / "summary.json"
        summary = json.loads(summary_file.read_text(encoding="utf-8")) if summary_file.is_file() else {}
        part = summary.get("participation", [])
        rows.append({"run": str(r), "rate": settings["link_rate"], "compressor": settings["compressor"],
                     "control_priority": settings.get("control_priority", False),
                     **summarize(read_samples(probe_file)), "syncs": len(part),
                     "min_participants": min((x["participants"] for x in part), default=None),
                     "participation_ok": summary.get("participation_ok")})
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "control_plane.json").write_text(json.dumps({"runs": rows}, indent=1) + "\n")
    (Path(out) / "control_plane.md").write_text("# The control plane's latency\n\nms; made by `gradzip chaos "
                                                "control-plane` from `control_probe.jsonl` of each run.\n\n"
                                                + table(rows) + "\n")
    return {"runs": rows}


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of :func:`report`'s rows (RTTs and heartbeat ages in ms)."""
    def f(x: Any) -> str:
        return "-" if x is None else f"{x:g}" if isinstance(x, float) else str(x)

    lines = ["| rate | control priority | idle RTT median / max | during exchange: n, RTT median / p90 / max | "
             "failed | oldest heartbeat median / max | max queue (bytes) | syncs | min participants |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        i, ld, hb = r["idle_rtt_ms"], r["loaded_rtt_ms"], r["heartbeat_age_ms"]
        lines.append(f"| {r['rate']} | {'on' if r['control_priority'] else 'off'} | {f(i['median'])} / {f(i['max'])} | "
                     f"{ld['n']}: {f(ld['median'])} / {f(ld['p90'])} / {f(ld['max'])} | "
                     f"{r['idle_failed'] + r['loaded_failed']} | {f(hb['median'])} / {f(hb['max'])} | "
                     f"{r['max_backlog_bytes']} | {r['syncs']} | {f(r['min_participants'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gradzip.chaos.control")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ns", default="", help="comma-separated namespaces whose egress backlog to read")
    p.add_argument("--out", required=True)
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=10.0)
    a = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    probe(a.host, a.port, [n for n in a.ns.split(",") if n], Path(a.out), a.interval, a.timeout, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
