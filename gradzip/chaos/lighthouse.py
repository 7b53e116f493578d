"""A torchft Lighthouse in a process of its own, so that it outlives every replica group:
``python -m gradzip.chaos.lighthouse --port P --min-replicas M [--join-timeout-ms J]
[--heartbeat-timeout-ms B]``. It prints its address once it serves and runs until SIGTERM/SIGINT.

``--heartbeat-timeout-ms``: a group whose heartbeat is older is not alive (a stopped or cut-off
group drops out of the next quorum); ``--join-timeout-ms``: once enough groups asked for a quorum,
how long the Lighthouse waits for the other live ones (a slow but live group still gets in)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gradzip.chaos.lighthouse")
    p.add_argument("--port", type=int, default=29510)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--join-timeout-ms", type=int, default=10000)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=3000)
    a = p.parse_args(argv)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at INFO otherwise
    from torchft.coordination import LighthouseServer  # noqa: PLC0415 (the optional ft extra)

    server = LighthouseServer(bind=f"[::]:{a.port}", min_replicas=a.min_replicas, join_timeout_ms=a.join_timeout_ms,
                              heartbeat_timeout_ms=a.heartbeat_timeout_ms)
    print(server.address(), flush=True)
    done.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
