"""Emulated hosts with shaped links on one Linux machine: network namespaces, veth, a bridge, tc.

Layout of a testbed with prefix ``gz`` and N hosts::

    netns gz-br:  bridge br0, ports h0 .. h{N-1}          (the "switch")
    netns gz-hI:  eth0 = 198.18.0.(I+1)/24, the other end of port hI
                  egress of eth0 shaped by tc: htb (rate) [-> netem (delay, loss)]

Nothing is created in the root namespace: the veth pairs are created with both ends directly in
their namespaces, so the testbed's traffic cannot leave the machine, and the addresses come from
the benchmarking range 198.18.0.0/15 (RFC 2544) so they cannot clash with real ones.

Shaping, per host, on the host's egress (so every host sends at most ``rate``, like a NIC):

- ``htb`` class 1:10 with ``rate == ceil``: a token bucket. It counts each GSO segment with its
  headers, so TCP goodput is about MSS/(MSS+66) of the rate (95.6 % at MTU 1500).
- delay and loss: a ``netem`` leaf under that class when the kernel has sch_netem. Kernels without
  it (CONFIG_NET_SCH_NETEM unset) get loss from a classic-BPF filter that sends a random fraction
  of packets to a class whose queue holds nothing (bfifo limit 0); delay then cannot be emulated
  and asking for it is an error. Loss, either way, applies to the packets as the kernel queues
  them: a GSO super-packet (up to 64 KB) is dropped as a whole.

State: ``/run/gradzip-netem/<prefix>.json`` records what was built (``GRADZIP_NETEM_STATE_DIR``
overrides the directory), so ``status`` and ``down`` work from any process. ``down`` also removes
namespaces that follow the naming scheme but have no state (an earlier process killed with -9).
A lock file serialises ``up``/``down``/``reshape`` of one prefix.

Readiness: every host has a permanent neighbour entry (IP -> MAC) for every other host, so no
packet ever waits on ARP (a datagram sent to an unresolved neighbour is queued, up to
``unres_qlen`` packets, and the rest are dropped without an error to ``sendto``; an ARP reply lost
to the emulated loss left a whole burst undelivered), and :func:`up` returns only after a probe
datagram has crossed every ordered pair of hosts. The MAC addresses are fixed by the host index
(:meth:`Testbed.host_mac`).

Failure safety: :func:`up` builds inside ``try``; any exception, Ctrl-C or SIGTERM deletes every
namespace it created (which removes their links and qdiscs) before re-raising.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gradzip.errors import GradzipError
from gradzip.io import atomic_write_json, file_lock
from gradzip.netem.iproute import BRIDGE_IF, HOST_IF, NetemError, run_tool, tool
from gradzip.netem.readiness import fill_neighbours, host_socket, wait_until_ready
from gradzip.netem.shaping import loss_method, shape
from gradzip.netem.spec import Shaping, parse_loss

__all__ = ["Shaping", "Testbed", "HostCounters", "NetemError", "parse_loss", "up", "down", "reshape", "status",
           "counters", "host_socket", "wait_until_ready"]

ALLOWED = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544 benchmarking range
DEFAULT_PREFIX = "gz"
DEFAULT_SUBNET = "198.18.0.0/24"
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21
# Test hook: a build step at which to fail ("raise:<step>") or to send ourselves SIGTERM or SIGINT
# ("sigterm:<step>", "sigint:<step>"); steps are "bridge", "host:<i>", "shape:<i>". Unset in normal use.
FAIL_ENV = "GRADZIP_NETEM_FAIL_AT"


@dataclass
class Testbed:
    """What was built. Plain data; see the module docstring for the layout."""

    prefix: str
    hosts: int
    shaping: Shaping
    subnet: str = DEFAULT_SUBNET
    mtu: int = 1500
    loss_method: str = "none"  # "none" | "netem" | "bpf"
    created: float = 0.0

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    def host_ns(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def host_addr(self, i: int) -> str:
        return str(ipaddress.ip_network(self.subnet)[i + 1])

    def host_mac(self, i: int) -> str:
        """The MAC of host ``i``'s eth0: locally administered (02:...), fixed by the index, so that
        every host's neighbour table can be filled before any packet is sent."""
        return f"02:67:7a:00:{i >> 8:02x}:{i & 0xFF:02x}"

    @property
    def prefixlen(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    def namespaces(self) -> list[str]:
        return [self.bridge_ns] + [self.host_ns(i) for i in range(self.hosts)]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shaping"] = asdict(self.shaping)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Testbed:
        d = dict(d)
        d["shaping"] = Shaping(**d["shaping"])
        return cls(**d)


@dataclass
class HostCounters:
    """Counters of one host's interface: what the host sent (tx) and received (rx), and what its
    shaper queued (``shaped_bytes`` counts each GSO segment with its own headers)."""

    tx_bytes: int
    tx_packets: int
    rx_bytes: int
    shaped_bytes: int
    drops: int


# ------------------------------------------------------------------------------ prerequisites
def _effective_caps() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def check_privileges() -> None:
    """Raise NetemError unless this process may create namespaces and configure tc."""
    if not Path("/proc/self/status").exists() or os.uname().sysname != "Linux":
        raise NetemError("gradzip netem needs Linux (network namespaces and tc)")
    caps = _effective_caps()
    needed = (("CAP_NET_ADMIN", CAP_NET_ADMIN), ("CAP_SYS_ADMIN", CAP_SYS_ADMIN))  # tc and links; `ip netns add`
    missing = [n for n, bit in needed if not caps >> bit & 1]
    if missing:
        raise NetemError(
            f"gradzip netem needs root (or {' and '.join(missing)}: namespaces, links and tc qdiscs); "
            "run it with sudo"
        )
    tool("ip")
    tool("tc")


def validate_prefix(prefix: str) -> str:
    if not re.fullmatch(r"[a-z][a-z0-9]{0,11}", prefix or ""):
        raise GradzipError(f"bad testbed prefix {prefix!r}: use 1-12 lower-case letters and digits, "
                           "starting with a letter")
    return prefix


def validate_subnet(subnet: str, hosts: int) -> str:
    try:
        net = ipaddress.ip_network(subnet, strict=True)
    except ValueError as e:
        raise GradzipError(f"bad subnet {subnet!r}: {e} (e.g. 198.18.0.0/24)") from None
    if net.version != 4 or not net.subnet_of(ALLOWED):  # type: ignore[arg-type]
        raise GradzipError(f"subnet {subnet} is outside the benchmarking range {ALLOWED}; use e.g. 198.18.0.0/24")
    if hosts > net.num_addresses - 2:
        raise GradzipError(f"subnet {subnet} has room for {net.num_addresses - 2} hosts, not {hosts}")
    return str(net)


# ------------------------------------------------------------------------------ commands
def list_namespaces() -> list[str]:
    p = run_tool("ip", "-j", "netns", "list", check=False)
    if p.returncode != 0 or not p.stdout.strip():
        return []
    return [d["name"] for d in json.loads(p.stdout)]


def owned_namespaces(prefix: str, names: list[str]) -> list[str]:
    pat = re.compile(re.escape(prefix) + r"-(br|h\d+)")
    return [n for n in names if pat.fullmatch(n)]


def _hook(step: str) -> None:
    spec = os.environ.get(FAIL_ENV, "")
    action, _, at = spec.partition(":")
    if at != step:
        return
    if action in ("sigterm", "sigint"):
        os.kill(os.getpid(), signal.SIGTERM if action == "sigterm" else signal.SIGINT)
        time.sleep(5)  # the handler raises before this returns
    raise NetemError(f"injected failure at step {step} ({FAIL_ENV}={spec})")


# ------------------------------------------------------------------------------ state
def state_dir() -> Path:
    return Path(os.environ.get("GRADZIP_NETEM_STATE_DIR", "/run/gradzip-netem"))


def _state_path(prefix: str) -> Path:
    return state_dir() / f"{prefix}.json"


def load(prefix: str = DEFAULT_PREFIX) -> Testbed | None:
    """The recorded testbed of ``prefix``, or None."""
    try:
        return Testbed.from_dict(json.loads(_state_path(prefix).read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError):
        return None  # unreadable state: treated as absent; `down` still removes the namespaces


def _save(tb: Testbed) -> None:
    path = _state_path(tb.prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, tb.to_dict(), indent=1)


def _locked(prefix: str) -> contextlib.AbstractContextManager[None]:
    return file_lock(state_dir() / f"{prefix}.lock")


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """Turn SIGTERM (and SIGHUP) into SystemExit so that ``finally`` blocks run (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """Let a rollback finish even if the user presses Ctrl-C again."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _delete(names: list[str]) -> None:
    # Hosts first, then the bridge; deleting a namespace deletes its links and qdiscs.
    for ns in sorted(names, key=lambda n: n.endswith("-br")):
        run_tool("ip", "netns", "del", ns, check=False)


# ------------------------------------------------------------------------------ up / down
def up(
    hosts: int,
    shaping: Shaping,
    prefix: str = DEFAULT_PREFIX,
    subnet: str = DEFAULT_SUBNET,
    mtu: int = 1500,
) -> tuple[Testbed, str]:
    """Build (or keep, or reshape) the testbed. Returns it and what happened: ``"created"``,
    ``"unchanged"`` (same parameters: a no-op) or ``"reshaped"`` (same hosts, new shaping).

    A testbed that is up with another host count, subnet or MTU is an error (``down`` first).
    On any failure or signal, everything created by this call is removed before raising.
    """
    validate_prefix(prefix)
    if not 1 <= hosts <= 250:
        raise GradzipError(f"--hosts must be between 1 and 250, got {hosts}")
    if not 576 <= mtu <= 65000:
        raise GradzipError(f"--mtu must be between 576 and 65000, got {mtu}")
    subnet = validate_subnet(subnet, hosts)
    check_privileges()
    with _locked(prefix):
        existing = owned_namespaces(prefix, list_namespaces())
        old = load(prefix)
        if old is not None and sorted(existing) == sorted(old.namespaces()):
            if (old.hosts, old.subnet, old.mtu) != (hosts, subnet, mtu):
                raise NetemError(
                    f"testbed {prefix!r} is up with {old.hosts} hosts on {old.subnet}, MTU {old.mtu}; "
                    f"run `gradzip netem down{_pfx(prefix)}` first"
                )
            if old.shaping == shaping:
                return old, "unchanged"
            return _reshape_locked(old, shaping), "reshaped"
        if existing:  # leftovers of a killed process, or a state file that was lost
            _delete(existing)
        _state_path(prefix).unlink(missing_ok=True)
        return _build(Testbed(prefix, hosts, shaping, subnet, mtu, created=time.time())), "created"


def _pfx(prefix: str) -> str:
    return "" if prefix == DEFAULT_PREFIX else f" --prefix {prefix}"


def _build(tb: Testbed) -> Testbed:
    created: list[str] = []
    ok = False
    try:
        with _signals_raise():
            br = tb.bridge_ns
            run_tool("ip", "netns", "add", br)
            created.append(br)
            run_tool("ip", "-n", br, "link", "add", BRIDGE_IF, "type", "bridge")
            run_tool("ip", "-n", br, "link", "set", BRIDGE_IF, "addrgenmode", "none")
            run_tool("ip", "-n", br, "link", "set", BRIDGE_IF, "up")
            tb.loss_method = loss_method(tb.shaping, br)
            _hook("bridge")
            for i in range(tb.hosts):
                ns, port = tb.host_ns(i), f"h{i}"
                run_tool("ip", "netns", "add", ns)
                created.append(ns)
                run_tool("ip", "link", "add", HOST_IF, "netns", ns, "address", tb.host_mac(i), "mtu", str(tb.mtu),
                        "type", "veth", "peer", "name", port, "netns", br, "mtu", str(tb.mtu))
                # No IPv6 link-local address: no router/neighbour solicitations in the counters.
                run_tool("ip", "-n", ns, "link", "set", HOST_IF, "addrgenmode", "none")
                run_tool("ip", "-n", br, "link", "set", port, "addrgenmode", "none")
                run_tool("ip", "-n", br, "link", "set", port, "master", BRIDGE_IF)
                run_tool("ip", "-n", br, "link", "set", port, "up")
                run_tool("ip", "-n", ns, "addr", "add", f"{tb.host_addr(i)}/{tb.prefixlen}", "dev", HOST_IF)
                run_tool("ip", "-n", ns, "link", "set", "lo", "up")
                run_tool("ip", "-n", ns, "link", "set", HOST_IF, "up")
                _hook(f"host:{i}")
                shape(ns, tb.shaping, tb.loss_method)
                _hook(f"shape:{i}")
            fill_neighbours(tb, run_tool)
            _hook("neigh")
            wait_until_ready(tb)
            _save(tb)
            ok = True
            return tb
    finally:
        if not ok:
            with signals_ignored():
                # Also whatever a signal hit between `ip netns add` and the bookkeeping: up() only
                # builds when no namespace of this prefix existed, so all of them are ours.
                _delete(sorted(set(created) | set(owned_namespaces(tb.prefix, list_namespaces()))))
                _state_path(tb.prefix).unlink(missing_ok=True)


def reshape(prefix: str, shaping: Shaping) -> Testbed:
    """Change the shaping of a running testbed (all hosts)."""
    validate_prefix(prefix)
    check_privileges()
    with _locked(prefix):
        tb = load(prefix)
        if tb is None:
            raise NetemError(f"no testbed {prefix!r} is up; run `gradzip netem up{_pfx(prefix)}` first")
        return _reshape_locked(tb, shaping)


def _reshape_locked(tb: Testbed, shaping: Shaping) -> Testbed:
    method = loss_method(shaping, tb.bridge_ns)
    for i in range(tb.hosts):
        shape(tb.host_ns(i), shaping, method)
    tb = Testbed(tb.prefix, tb.hosts, shaping, tb.subnet, tb.mtu, method, tb.created)
    wait_until_ready(tb)
    _save(tb)
    return tb


def down(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove the testbed's namespaces (with their links and qdiscs) and its state. Idempotent:
    returns the namespaces removed (empty when nothing was up)."""
    validate_prefix(prefix)
    check_privileges()
    with _locked(prefix), signals_ignored():
        names = owned_namespaces(prefix, list_namespaces())
        _delete(names)
        _state_path(prefix).unlink(missing_ok=True)
        left = owned_namespaces(prefix, list_namespaces())
    if left:
        raise NetemError(f"could not remove namespaces {', '.join(left)} (processes still inside? see `ip netns pids`)")
    return names


# ------------------------------------------------------------------------------ counters
def counters(tb: Testbed, hosts: int | None = None) -> list[HostCounters]:
    """Interface and shaper counters of the first ``hosts`` hosts (default all)."""
    out = []
    for i in range(tb.hosts if hosts is None else hosts):
        ns = tb.host_ns(i)
        link = json.loads(run_tool("ip", "-n", ns, "-s", "-j", "link", "show", "dev", HOST_IF).stdout)[0]["stats64"]
        qdiscs = json.loads(run_tool("tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", HOST_IF).stdout or "[]")
        root = next((q for q in qdiscs if q.get("root")), {})
        out.append(HostCounters(
            tx_bytes=int(link["tx"]["bytes"]), tx_packets=int(link["tx"]["packets"]),
            rx_bytes=int(link["rx"]["bytes"]), shaped_bytes=int(root.get("bytes", 0)),
            drops=int(root.get("drops", 0)),  # the root counts its children's drops too
        ))
    return out


def status(prefix: str = DEFAULT_PREFIX) -> dict[str, Any] | None:
    """A JSON-able description of the testbed (None if nothing of ``prefix`` exists)."""
    validate_prefix(prefix)
    check_privileges()
    existing = owned_namespaces(prefix, list_namespaces())
    tb = load(prefix)
    if tb is None:
        return None if not existing else {"prefix": prefix, "state": "broken", "namespaces": existing}
    missing = sorted(set(tb.namespaces()) - set(existing))
    d: dict[str, Any] = tb.to_dict()
    d["state"] = "broken" if missing else "up"
    d["missing"] = missing
    d["shaping_text"] = tb.shaping.describe()
    if not missing:
        d["counters"] = [asdict(c) for c in counters(tb)]
    d["host_list"] = [{"namespace": tb.host_ns(i), "address": tb.host_addr(i)} for i in range(tb.hosts)]
    return d
