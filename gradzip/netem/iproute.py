"""The commands a testbed is built with: iproute2's ``ip`` and ``tc`` (:func:`run_tool`), and the
names of the testbed's interfaces."""

from __future__ import annotations

import os
import shutil
import subprocess

from gradzip.errors import GradzipError

HOST_IF = "eth0"
BRIDGE_IF = "br0"


class NetemError(GradzipError):
    """A testbed command failed or the machine cannot host a testbed."""


def tool(name: str) -> str:
    sbin = (f"/usr/sbin/{name}", f"/sbin/{name}")  # not on a non-root user's PATH on some distributions
    path = shutil.which(name) or next((p for p in sbin if os.access(p, os.X_OK)), None)
    if not path:
        raise NetemError(f"the `{name}` command is missing: install iproute2 (e.g. apt-get install iproute2)")
    return path


def run_tool(*argv: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    path = tool(argv[0])
    try:
        p = subprocess.run([path, *argv[1:]], capture_output=True, text=True, timeout=30, input=stdin)
    except subprocess.TimeoutExpired:
        raise NetemError(f"`{' '.join(argv)}` did not finish within 30 s") from None
    if check and p.returncode != 0:
        msg = " ".join((p.stderr or p.stdout).split()) or f"exit code {p.returncode}"
        raise NetemError(f"`{' '.join(argv)}` failed: {msg}")
    return p
