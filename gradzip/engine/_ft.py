"""torchft glue for :mod:`gradzip.engine.ftdiloco`: the import, the Lighthouse, a replica group's
Manager, the quorum it saw, the payload exchange on its process group, and the state digest.

torchft (``pip install "gradzip[ft]"``) is imported here and only here, lazily: gradzip imports
without it, and asking for fault tolerance without it is one line and exit code 2.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import torch
from torch import Tensor

from gradzip.errors import GradzipError

EXTRA_HINT = 'fault tolerance needs torchft: pip install "gradzip[ft]"'


def torchft() -> Any:
    """The ``torchft`` module, or a :class:`GradzipError` (one line) naming the extra to install."""
    # torchft's Rust side logs every quorum at INFO (RUST_LOG, read once, at its first log line),
    # and its Manager warns at every reconfiguration that NCCL's flight recorder is absent (gloo).
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft as ft  # noqa: PLC0415 (optional dependency)
    except ImportError:
        raise GradzipError(EXTRA_HINT) from None
    logging.getLogger("torchft.manager").setLevel(logging.ERROR)
    return ft


def start_lighthouse(min_replicas: int, port: int = 0, join_timeout_ms: int = 200,
                     heartbeat_timeout_ms: int = 5000) -> Any:
    """An in-process Lighthouse on ``port`` (0: a free one) for a local run; ``.address()`` is
    what the replica groups are given, ``.shutdown()`` stops it. ``join_timeout_ms``: how long it
    waits for more replicas once ``min_replicas`` asked for a quorum."""
    torchft()
    from torchft.coordination import LighthouseServer  # noqa: PLC0415 (public since torchft 0.2)

    return LighthouseServer(bind=f"[::]:{port}", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            heartbeat_timeout_ms=heartbeat_timeout_ms)


def await_file(path: Path, poll: float = 0.05) -> None:
    """Block until ``path`` exists: a warm spare's go signal. Its process is built (interpreter,
    imports, model, data) and idle until then, which ``path.waiting`` (created first) tells whoever
    started it; they end it if it is never needed."""
    path.with_name(path.name + ".waiting").touch()
    while not path.exists():
        time.sleep(poll)


def check_lighthouse(addr: str, wait: float = 0.0, timeout: float = 5.0) -> None:
    """A :class:`GradzipError` (one line) unless something answers at ``addr`` (``http://host:port``)
    within ``wait`` seconds (tried every 0.25 s: groups started together wait for the one that
    starts the Lighthouse)."""
    if not addr.startswith(("http://", "https://")):
        raise GradzipError(f"lighthouse address {addr!r} must look like http://HOST:PORT")
    hostport = addr.split("://", 1)[1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    deadline = time.monotonic() + wait
    while True:
        try:
            left = max(deadline - time.monotonic(), 1.0)  # an address that drops packets: about the wait
            with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=min(timeout, left)):
                return
        except (OSError, ValueError) as e:
            if isinstance(e, ValueError) or time.monotonic() + 0.25 > deadline:
                waited = f" after {wait:g} s" if wait > 0 else ""
                raise GradzipError(f"no torchft Lighthouse answers at {addr}{waited} ({e.__class__.__name__}); "
                                   "start one (torchft_lighthouse --min_replicas N), give lighthouse=local, or "
                                   "wait longer for it (lighthouse_wait=S)") from None
        time.sleep(0.25)


class _Recorder:
    """Stands in for a Manager's client: passes every call through and keeps the last quorum's
    result (its members, max step and heal decision), which torchft does not expose."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@dataclass
class Group:
    """One replica group's torchft side: its Manager, process group, TCP store and quorum recorder."""

    manager: Any
    pg: Any
    store: Any
    recorder: _Recorder
    lighthouse: Any = None  # the in-process Lighthouse this group started, if any
    closed: bool = field(default=False)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.manager.shutdown(wait=False)
            if self.lighthouse is not None:
                self.lighthouse.shutdown()


def _transport_at(host: str, timeout: float) -> Any:
    """torchft's HTTP checkpoint transport, advertising ``host`` (torchft's own advertises
    ``socket.gethostname()``, which on a machine with several addresses may not be the one the
    other groups reach)."""
    from torchft.checkpointing.http_transport import HTTPTransport  # noqa: PLC0415

    class _At(HTTPTransport):  # type: ignore[misc,type-arg]
        def address(self) -> str:  # torchft's URL with this host in place of the machine's name
            url = urlsplit(super().address())
            return urlunsplit((url.scheme, f"{host}:{url.port}", url.path, url.query, url.fragment))

    return _At(timeout=timedelta(seconds=timeout), num_chunks=0)


def make_group(replica_id: str, lighthouse: str, min_replicas: int, load: Any, save: Any,
               timeout: float, host: str | None = None, rank: int = 0, world: int = 1,
               share_port: Callable[[int], int] | None = None) -> Group:
    """A Manager for this process as rank ``rank`` of a replica group of ``world`` ranks,
    speaking to ``lighthouse``. ``load``/``save``: the state a healing peer copies (torchft's HTTP
    checkpoint transport; each rank heals from the same rank of a live group). ``host``: the
    address the other groups reach this one at (its store, Manager and checkpoint server); None:
    this machine's loopback store and hostname (every group on one machine). The group's store is
    rank 0's; ``share_port`` (needed when ``world`` > 1) gives every rank rank 0's store port (a
    broadcast inside the group); torchft's Manager server runs on rank 0, and the quorum and the
    commit cover the group's ranks together."""
    ft = torchft()
    from torch.distributed import TCPStore  # noqa: PLC0415

    addr = host or "127.0.0.1"
    store = TCPStore(addr, 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = store.port if store is not None else 0
    if world > 1:
        if share_port is None:
            raise ValueError("a replica group of several ranks needs share_port")
        port = share_port(port)
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=timeout))
    where: dict[str, Any] = {} if host is None else {"hostname": host,
                                                      "checkpoint_transport": _transport_at(host, timeout)}
    manager = ft.Manager(pg=pg, load_state_dict=load, state_dict=save, min_replica_size=min_replicas,
                         use_async_quorum=False, timeout=timedelta(seconds=timeout),
                         quorum_timeout=timedelta(seconds=max(timeout, 60.0)),
                         connect_timeout=timedelta(seconds=timeout), rank=rank, world_size=world,
                         store_addr=addr, store_port=port, lighthouse_addr=lighthouse,
                         replica_id=replica_id, init_sync=True, **where)
    recorder = _Recorder(manager._client)
    manager._client = recorder  # the quorum goes through the recorder from now on
    return Group(manager, pg, store, recorder)


# ---------------------------------------------------------------------- the payload exchange
def payload_nbytes(payload: tuple[Tensor, ...]) -> int:
    """The payload's bytes on the wire: its tensors' data, no framing."""
    return sum(t.numel() * t.element_size() for t in payload)


def _pack(payload: tuple[Tensor, ...]) -> Tensor:
    buf = io.BytesIO()
    torch.save([t.detach().cpu().contiguous() for t in payload], buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _unpack(data: Tensor) -> tuple[Tensor, ...]:
    return tuple(torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True))


def allgather_payloads(pg: Any, payload: tuple[Tensor, ...], header: list[float],
                       world: int) -> list[tuple[list[float], tuple[Tensor, ...]]]:
    """Every participant's (header, payload), in quorum rank order, through ``pg`` (torchft's
    reconfigurable process group): one allgather of the fixed-size headers (with the packed sizes),
    one of the packed payloads padded to the largest. Raises on a lost peer (the caller reports it
    to the Manager, which then does not commit)."""
    from torch.distributed.distributed_c10d import AllgatherOptions  # noqa: PLC0415

    packed = _pack(payload)
    head = torch.tensor([float(packed.numel()), *header], dtype=torch.float64)
    heads = [torch.empty_like(head) for _ in range(world)]
    pg.allgather([heads], [head], AllgatherOptions()).wait()
    size = int(max(h[0].item() for h in heads))
    padded = torch.zeros(size, dtype=torch.uint8)
    padded[:packed.numel()] = packed
    outs = [torch.empty_like(padded) for _ in range(world)]
    pg.allgather([outs], [padded], AllgatherOptions()).wait()
    return [(h[1:].tolist(), _unpack(o[:int(h[0].item())])) for h, o in zip(heads, outs)]


# ---------------------------------------------------------------------- the digest
def digest(tensors: list[Tensor], outer_state: dict[str, Any]) -> str:
    """sha256 over the bytes of ``tensors`` and of every tensor in the outer optimizer's state
    (in its state_dict's order), with their dtypes and shapes: equal digests, equal states."""
    h = hashlib.sha256()

    def eat(t: Tensor) -> None:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())

    for t in tensors:
        eat(t)
    for pid in sorted(outer_state.get("state", {})):
        for name in sorted(outer_state["state"][pid]):
            v = outer_state["state"][pid][name]
            if isinstance(v, Tensor):
                eat(v)
            else:
                h.update(f"{name}={v}".encode())
    return h.hexdigest()
