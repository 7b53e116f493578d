"""The process groups of the ``torch`` backend: the rendezvous of the default group
(:func:`init_process_group`, with Gloo bound to the interface of ``GRADZIP_BIND_ADDR``), the groups
of a split or a control channel (:func:`split_groups`), those that only their members create
(:func:`member_group`, for splits of a sub-communicator), and what counts as a timeout in
torch.distributed's errors."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from datetime import timedelta

import torch
import torch.distributed as dist

from gradzip.comm.base import split_order
from gradzip.errors import CommError, CommTimeout, GradzipError


def split_groups(group, backend: str, members: list[int], perm: list[int] | None, device, every: bool,
                 colours: list[int], keys: list[int], colour: int, instance: str, timeout: timedelta) -> tuple:
    """(data group, Gloo side group) of ``colour`` for a split of the communicator over ``group``
    (``backend``; ``members[r]``: the global rank of its rank ``r``; ``perm``: their ranks in torch's
    group, None: the same). ``every``: every process of the job is a member, so torch's public
    ``new_group`` serves, entered for every colour in sorted order on every process (as torch
    requires); else the groups are made by their members alone, under names derived from
    ``instance`` (Gloo), or with ``split_group`` from ``group`` (NCCL)."""
    orders = {c: split_order(colours, keys, c) for c in sorted(set(colours))}
    if every:
        extra = {"device_id": device} if backend == "nccl" else {}
        mine = None
        for c, order in orders.items():
            ranks = sorted(members[i] for i in order)
            groups = (dist.new_group(ranks, timeout=timeout, backend=backend, **extra),
                      dist.new_group(ranks, timeout=timeout, backend="gloo"))
            mine = groups if c == colour else mine
        return mine
    ranks = sorted(members[i] for i in orders[colour])
    side = member_group(ranks, "gloo", f"gradzip/{instance}/side", timeout)
    if backend != "nccl":
        return member_group(ranks, backend, f"gradzip/{instance}/data", timeout), side
    torch_rank = perm or list(range(len(members)))  # split_group takes the parent's torch ranks
    split = [[torch_rank[i] for i in order] for order in orders.values()]
    return dist.split_group(group, split, timeout=timeout), side


def member_group(ranks: list[int], backend: str, name: str, timeout: timedelta):
    """A process group over the sorted global ``ranks`` that only its members create. torch's
    public ``new_group`` must be entered by every process of the job, and its
    ``use_local_synchronization`` form names the group by how many groups this process has made,
    which differs between processes once sub-communicators split; so this calls the helper that
    ``new_group`` itself uses, with ``name`` (unique, derived alike on every member) as the group's
    name and store prefix, and registers the rank mapping as ``new_group`` does."""
    c10d = dist.distributed_c10d
    pg, _ = c10d._new_process_group_helper(len(ranks), ranks.index(dist.get_rank()), ranks, backend,
                                          c10d._get_default_store(), name, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg


def is_timeout(e: BaseException) -> bool:
    s = str(e).lower()
    return isinstance(e, TimeoutError) or "timed out" in s or "timeout" in s


def init_process_group(backend: str, rank: int, world_size: int, addr: str | None, port: int | None,
                        timeout: float, device: torch.device | None) -> None:
    if backend not in ("gloo", "nccl"):
        raise GradzipError(f"torch backend {backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (CUDA)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise GradzipError("backend nccl needs CUDA, but torch.cuda.is_available() is False; use --backend gloo")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        init_method = "env://"  # torchrun's agent hosts the store: survives the loss of rank 0
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    else:
        addr = addr or os.environ.get("MASTER_ADDR")
        port = port or (int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None)
        if not addr or not port:
            raise GradzipError("torch backend: rendezvous address unknown: set MASTER_ADDR and MASTER_PORT "
                               "(rank 0's host and a free port)")
        host = f"[{addr}]" if ":" in addr else addr
        init_method, where = f"tcp://{host}:{port}", f"{addr}:{port}"
    bind_gloo_to_addr()
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = device or torch.device("cuda", torch.cuda.current_device())
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout), **kwargs)
    except (RuntimeError, TimeoutError) as e:
        msg = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        cls = CommTimeout if is_timeout(e) else CommError
        raise cls(f"init: rank {rank} of {world_size} could not rendezvous at {where} within {timeout:g} s: {msg}. "
                  f"Check that all {world_size} ranks were started and that rank 0's host and port are "
                  "reachable") from e


def bind_gloo_to_addr() -> None:
    """``GRADZIP_BIND_ADDR`` (set per rank by ``spawn_local(bind_addrs=...)``): make Gloo use the
    interface that owns this address (Gloo reads ``GLOO_SOCKET_IFNAME`` when it creates its device)."""
    addr = os.environ.get("GRADZIP_BIND_ADDR")
    if not addr or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    ifname = interface_of(addr)
    if ifname is None:
        raise GradzipError(f"GRADZIP_BIND_ADDR={addr} is not an address of any interface on this host")
    os.environ["GLOO_SOCKET_IFNAME"] = ifname


def interface_of(addr: str) -> str | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
            except OSError:
                continue
            if got == addr:
                return name
    finally:
        sock.close()
    return None
