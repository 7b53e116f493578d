"""Shaping of a testbed host's egress with tc: an htb token bucket at the link's rate, a class
that serves pure ACKs first, and delay and loss from ``netem`` leaves (or, on kernels without
sch_netem, loss from a classic-BPF filter into a queue that holds nothing). An ``unshaped`` link
gets a plain ``pfifo_fast`` root instead: no rate limit (the veth at full speed), but a qdisc that
still counts the bytes and frames sent (``wire_frame_bytes``). See :mod:`gradzip.netem.testbed`
for the layout."""

from __future__ import annotations

from gradzip.netem.iproute import HOST_IF, NetemError, run_tool
from gradzip.netem.spec import Shaping

_NETEM_OK: bool | None = None


def netem_available(probe_ns: str) -> bool:
    """Whether the kernel has sch_netem (probed once, on a throw-away veth inside ``probe_ns``)."""
    global _NETEM_OK
    if _NETEM_OK is None:
        run_tool("ip", "-n", probe_ns, "link", "add", "gzprobe0", "type", "veth", "peer", "name", "gzprobe1")
        try:
            p = run_tool("tc", "-n", probe_ns, "qdisc", "add", "dev", "gzprobe0", "root", "netem", "delay", "1ms",
                        check=False)
            _NETEM_OK = p.returncode == 0
        finally:
            run_tool("ip", "-n", probe_ns, "link", "del", "gzprobe0", check=False)
    return _NETEM_OK


def loss_method(shaping: Shaping, probe_ns: str) -> str:
    if not shaping.delay_s and not shaping.loss_pct:
        return "none"
    if netem_available(probe_ns):
        return "netem"
    if shaping.delay_s:
        raise NetemError(
            "this kernel has no sch_netem (CONFIG_NET_SCH_NETEM), which --delay needs: "
            "use --delay 0, or `modprobe sch_netem` on a kernel that has the module"
        )
    return "bpf"


def shape(ns: str, shaping: Shaping, method: str) -> None:
    """htb root 1: -> link class 1:1 (rate) -> 1:5 small TCP packets (pure ACKs), priority 0, and
    1:10 everything else; netem leaves under both for delay/loss; 1:20 is the bpf loss sink.

    Why the ACK class: in a ring every host sends and receives at once, so its egress queue holds
    its own data *and* the ACKs of the flow it receives. With one FIFO those ACKs wait behind up
    to several MB of data (TCP small queues allow 4 MB per socket here), the reverse flow's RTT
    balloons and it becomes window-limited: one direction then runs 20-30 % below the rate.
    A switch port at 10 Gbit/s drains such a queue in milliseconds; at emulated rates it takes
    seconds, so the emulator serves small packets first (as fq/fq_codel would)."""
    tc = ("tc", "-n", ns)
    dev = ("dev", HOST_IF)
    run_tool(*tc, "qdisc", "del", *dev, "root", check=False)
    if shaping.rate_bps is None:  # unshaped: no rate, no delay or loss (Shaping refuses them)
        run_tool(*tc, "qdisc", "add", *dev, "root", "handle", "1:", "pfifo_fast")
        return
    bps = shaping.rate_bps
    run_tool(*tc, "qdisc", "add", *dev, "root", "handle", "1:", "htb", "default", "10")

    def cls(parent: str, classid: str, rate: float, *extra: str) -> None:
        # quantum only matters between sibling classes; a fixed one silences htb's r2q warning.
        run_tool(*tc, "class", "add", *dev, "parent", parent, "classid", classid, "htb", "rate", f"{int(rate)}bit",
                "ceil", f"{int(bps)}bit", "quantum", "60000", *extra)

    cls("1:", "1:1", bps)
    cls("1:1", "1:5", bps / 20, "prio", "0")
    cls("1:1", "1:10", bps * 19 / 20, "prio", "1")
    if method == "netem":
        args = ["delay", f"{shaping.delay_s * 1e6:.0f}us"] if shaping.delay_s else []
        if shaping.loss_pct:
            args += ["loss", f"{shaping.loss_pct:g}%"]
        for leaf in ("5", "10"):
            run_tool(*tc, "qdisc", "add", *dev, "parent", f"1:{leaf}", "handle", f"{leaf}:", "netem", *args,
                    "limit", "100000")
    elif method == "bpf":
        # Classic BPF: A = random u32; if A >= threshold classify into 1:20 (queue of 0 bytes = drop).
        threshold = min(2**32 - 1, int(round(2**32 * (1 - shaping.loss_pct / 100))))
        code = f"4,32 0 0 {2**32 - 0x1000 + 56},53 0 1 {threshold},6 0 0 {2**32 - 1},6 0 0 0"
        cls("1:", "1:20", bps)
        run_tool(*tc, "qdisc", "add", *dev, "parent", "1:20", "handle", "20:", "bfifo", "limit", "0")
        run_tool(*tc, "filter", "add", *dev, "parent", "1:", "pref", "1", "bpf", "bytecode", code, "classid", "1:20")
    # IPv4 without options (IHL 5), TCP, total length < 128 bytes: pure ACKs (with SACK blocks).
    run_tool(*tc, "filter", "add", *dev, "parent", "1:", "protocol", "ip", "pref", "2", "u32",
            "match", "ip", "protocol", "6", "0xff", "match", "u8", "0x05", "0x0f", "at", "0",
            "match", "u16", "0x0000", "0xff80", "at", "2", "flowid", "1:5")


CONTROL_PREF = "3"  # after the loss/partition filters (pref 1), which must still drop control packets


def prioritize_ports(ns: str, ports: tuple[int, ...]) -> None:
    """Serve TCP traffic to or from each of ``ports`` (either direction: the port as source or as
    destination) in the priority class 1:5 of a shaped host's egress, with the pure ACKs.

    Why: a control plane (torchft's heartbeats and quorum RPCs to the Lighthouse) shares the host's
    link with the bulk exchange. In the one data class its request or reply waits behind the
    queued bulk bytes, seconds at 10 Mbit/s, which starves heartbeats; a real deployment gives
    such traffic its own priority (DSCP/traffic class). The class's guaranteed rate (rate / 20) is
    far above a control plane's, and its ceiling is the link: priority, never a second link.
    Needs a shaped host (the htb root of :func:`shape`). The ports sit at fixed offsets (IPv4
    without options, as the ACK filter assumes: u32's ``tcp`` matches need a header-length hash)."""
    tc = ("tc", "-n", ns)
    for port in ports:
        if not 0 < port < 65536:
            raise NetemError(f"control port {port} is not a TCP port (1..65535)")
        for field in ("sport", "dport"):
            run_tool(*tc, "filter", "add", "dev", HOST_IF, "parent", "1:", "protocol", "ip", "pref", CONTROL_PREF,
                     "u32", "match", "ip", "protocol", "6", "0xff", "match", "u8", "0x05", "0x0f", "at", "0",
                     "match", "ip", field, str(port), "0xffff",
                     "flowid", "1:5")
