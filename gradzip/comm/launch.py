"""Launcher environments, :func:`init_communicator`, and :func:`spawn_local`.

The same script runs unchanged under every launcher: :func:`detect_launcher_env` reads

==============  =============================================  ==========================================
launcher        rank / world size / local rank                 rendezvous (torch backends)
==============  =============================================  ==========================================
torchrun        RANK, WORLD_SIZE, LOCAL_RANK                   MASTER_ADDR, MASTER_PORT
mpirun (Open    OMPI_COMM_WORLD_RANK/_SIZE/_LOCAL_RANK         MASTER_ADDR/PORT if set; else 127.0.0.1
MPI) / mpiexec  (MPICH, Intel MPI: PMI_RANK, PMI_SIZE,         when every rank is on one host, or rank 0's
(MPICH)         MPI_LOCALRANKID)                               host sent over MPI; port: MASTER_PORT or
                                                               derived from the job id (same on all ranks)
srun (Slurm)    SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID      MASTER_ADDR, else the first host of
                                                               SLURM_STEP_NODELIST/SLURM_JOB_NODELIST
                                                               (``node[01-04,07],gpu5`` syntax); port:
                                                               MASTER_PORT, else derived from the job id
==============  =============================================  ==========================================

With none of them the process is rank 0 of 1.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from gradzip.comm.base import DEFAULT_TIMEOUT_S, Communicator
from gradzip.comm.mpi_backend import MPICommunicator
from gradzip.comm.torch_backend import TorchCommunicator
from gradzip.errors import GradzipError

BACKENDS = ("gloo", "nccl", "torch", "mpi")


@dataclass(frozen=True)
class LauncherEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    launcher: str  # "torchrun" | "gradzip" (spawn_local) | "mpirun" | "slurm" | "none"
    local_world_size: int | None = None

    def __post_init__(self) -> None:
        # Range checks before any c10d call: a bad value there waits out a timeout, then prints
        # pages of C++ frames. The variable names are the launcher's (torchrun's spelling otherwise).
        ws, rk = ("WORLD_SIZE", "RANK") if self.launcher in ("torchrun", "gradzip", "none") else (
            ("OMPI_COMM_WORLD_SIZE/PMI_SIZE", "OMPI_COMM_WORLD_RANK/PMI_RANK") if self.launcher == "mpirun"
            else ("SLURM_NTASKS", "SLURM_PROCID"))
        if self.world_size is None or self.world_size < 1:
            raise GradzipError(f"{ws}={self.world_size} from the {self.launcher} environment: the world size "
                               "must be a positive number of ranks")
        if self.rank is None or not 0 <= self.rank < self.world_size:
            raise GradzipError(f"{rk}={self.rank} is outside 0..{self.world_size - 1} ({ws}={self.world_size}): "
                               "each rank needs a distinct RANK below the world size")
        if self.local_rank < 0:
            raise GradzipError(f"LOCAL_RANK={self.local_rank} must not be negative")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise GradzipError(f"MASTER_PORT={self.master_port} is not a TCP port (1..65535)")

    @property
    def external(self) -> bool:
        """True when some launcher started this process (so the world size comes from it)."""
        return self.launcher != "none"


def quiet_torch_logs(env: dict[str, str] | os._Environ[str]) -> None:
    """Keep torch's C++ warnings (c10d's "sendBytes failed" with 20 stack frames per lost peer)
    off the terminal: gradzip names the lost rank in one line itself. ``GRADZIP_DEBUG=1`` keeps
    them; so does a TORCH_CPP_LOG_LEVEL the user set. Takes effect in processes started after."""
    if not env.get("GRADZIP_DEBUG"):
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for n in names:
        v = env.get(n)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError as e:
                raise GradzipError(f"environment variable {n}={v!r} is not an integer") from e
    return None


def _job_port(env: Mapping[str, str], *names: str) -> int | None:
    """A port derived from a job id the launcher gives every rank (so all ranks agree)."""
    for n in names:
        if env.get(n):
            return 20000 + zlib.crc32(f"{n}={env[n]}".encode()) % 20000
    return None


def detect_launcher_env(environ: Mapping[str, str] | None = None) -> LauncherEnv:
    """Rank, world size and rendezvous address from the launcher's environment (table above)."""
    env = os.environ if environ is None else environ
    addr = env.get("MASTER_ADDR") or None
    port = _int(env, "MASTER_PORT")
    if "RANK" in env and "WORLD_SIZE" in env:
        name = "gradzip" if env.get("GRADZIP_LAUNCHER") == "spawn_local" else "torchrun"
        return LauncherEnv(_int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK") or 0,
                           addr, port, name, _int(env, "LOCAL_WORLD_SIZE"))
    if "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        rank = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK")
        size = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID") or 0
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
        if size is None:
            raise GradzipError("mpirun environment without a world size (OMPI_COMM_WORLD_SIZE / PMI_SIZE)")
        if addr is None and local_size == size:
            addr = "127.0.0.1"  # every rank on this host
        port = port or _job_port(env, "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_JOBID", "SLURM_JOB_ID")
        return LauncherEnv(rank, size, local, addr, port or 29500, "mpirun", local_size)
    if "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        if addr is None:
            nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            addr = expand_nodelist(nodes)[0] if nodes else None
        job = f"{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}"
        port = port or _job_port({"SLURM_JOB": job}, "SLURM_JOB") or 29500
        return LauncherEnv(_int(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
                           _int(env, "SLURM_LOCALID") or 0, addr, port, "slurm",
                           _int(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"))
    return LauncherEnv(0, 1, 0, addr, port, "none", 1)


# ------------------------------------------------------------------ Slurm node lists
def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list: ``node[01-04,07],gpu5`` → node01..node04, node07, gpu5.
    Several bracket groups in one name (``r[1-2]n[1-2]``) expand to their product; zero padding
    follows the range's first number."""
    hosts: list[str] = []
    for item in _split_top(nodelist.strip()):
        hosts.extend(_expand_host(item, nodelist))
    if not hosts:
        raise GradzipError(f"empty Slurm node list {nodelist!r}")
    return hosts


def _split_top(s: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in s:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return [x for x in (o.strip() for o in out) if x]


def _expand_host(item: str, whole: str) -> list[str]:
    m = re.match(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$", item)
    if m is None:
        if "[" in item or "]" in item:
            raise GradzipError(f"malformed Slurm node list {whole!r} near {item!r}")
        return [item]
    head, body, tail = m.groups()
    values: list[str] = []
    for part in body.split(","):
        part = part.strip()
        r = re.fullmatch(r"(\d+)-(\d+)", part)
        if r:
            a, b = r.groups()
            if int(b) < int(a):
                raise GradzipError(f"malformed Slurm node list {whole!r}: range {part} goes down")
            values.extend(str(i).zfill(len(a)) for i in range(int(a), int(b) + 1))
        elif re.fullmatch(r"\w+", part):
            values.append(part)
        else:
            raise GradzipError(f"malformed Slurm node list {whole!r}: bad range {part!r}")
    rest = _expand_host(tail, whole) if tail else [""]
    return [head + v + t for v in values for t in rest]


# ------------------------------------------------------------------ init
def init_communicator(backend: str, timeout: float = DEFAULT_TIMEOUT_S) -> Communicator:
    """A Communicator for this process from the launcher's environment.

    ``backend``: ``gloo`` (CPU), ``nccl`` (CUDA), ``torch`` (nccl if CUDA is available, else gloo)
    or ``mpi``. ``timeout`` (seconds) bounds the rendezvous and every collective.
    """
    b = backend.lower()
    if b == "sim":
        raise GradzipError("backend sim runs every worker in one process: use gradzip.comm.SimWorld(n) "
                           "(gradzip train --backend sim --workers N)")
    if b not in BACKENDS:
        raise GradzipError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)} (or sim)")
    if timeout <= 0:
        raise GradzipError(f"timeout must be > 0 seconds, got {timeout}")
    env = detect_launcher_env()
    if b == "mpi":
        comm = MPICommunicator(timeout=timeout)
        if env.external and env.world_size != comm.world_size:
            comm.close()
            raise GradzipError(f"the {env.launcher} environment says world size {env.world_size} but MPI sees "
                               f"{comm.world_size} rank(s): start with `mpirun -n {env.world_size} ...` "
                               "(or use --backend gloo)")
        return comm
    if b == "torch":
        b = "nccl" if torch.cuda.is_available() else "gloo"
    addr, port = env.master_addr, env.master_port
    if env.world_size == 1 and addr is None:
        addr = "127.0.0.1"
    if env.world_size > 1 and addr is None and env.launcher == "mpirun":
        addr, port = _rendezvous_via_mpi(port)
    if env.world_size > 1 and addr is None:
        raise GradzipError(f"{env.launcher}: rendezvous address unknown: set MASTER_ADDR to rank 0's host")
    if port is None:
        port = free_port() if env.world_size == 1 else 29500
    try:  # before any c10d call, which would retry an unknown host until the timeout
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise GradzipError(f"MASTER_ADDR={addr!r} does not resolve ({e}): set it to rank 0's host name or "
                           "address") from None
    device = None
    if b == "nccl":
        if not torch.cuda.is_available():
            raise GradzipError("backend nccl needs CUDA, but torch.cuda.is_available() is False; use gloo")
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return TorchCommunicator(b, env.rank, env.world_size, master_addr=addr, master_port=port, timeout=timeout,
                             device=device)


def _rendezvous_via_mpi(port: int | None) -> tuple[str, int]:
    """Under mpirun across hosts without MASTER_ADDR: rank 0 sends its address over MPI."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise GradzipError("mpirun across hosts: set MASTER_ADDR (rank 0's host) and MASTER_PORT, "
                           "or install mpi4py so that gradzip can find rank 0's host") from e
    comm = MPI.COMM_WORLD
    info = None
    if comm.Get_rank() == 0:
        host = socket.gethostname()
        info = (socket.gethostbyname(host), port or free_port())
    return comm.bcast(info, root=0)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ spawn_local
def spawn_local(backend: str, workers: int, argv: Sequence[str], env_extra: Mapping[str, str] | None = None,
                timeout: float | None = None, bind_addrs: Sequence[str] | None = None,
                prefix: Callable[[int], Sequence[str]] | None = None, *, module: str = "gradzip",
                grace: float = 10.0, mpi_args: Sequence[str] = (),
                rank_env: Callable[[int], Mapping[str, str]] | None = None) -> int:
    """Run ``python -m <module> <argv>`` as ``workers`` local ranks; return the exit code.

    - ``gloo``/``nccl``/``torch``: starts the processes itself with RANK, WORLD_SIZE, LOCAL_RANK,
      LOCAL_WORLD_SIZE, MASTER_ADDR (127.0.0.1, or ``bind_addrs[0]``) and a free MASTER_PORT.
    - ``mpi``: runs the ``mpirun`` next to ``sys.executable`` (a venv's Open MPI wheel), else the
      one on PATH, as ``mpirun -n N --oversubscribe --bind-to none [--allow-run-as-root] python -m
      mpi4py -m <module> <argv>`` (``-m mpi4py``: an uncaught exception aborts every rank).

    Every child gets ``OMP_NUM_THREADS=1`` unless it is set, plus ``env_extra``. If a rank exits
    non-zero, the others get ``grace`` seconds to finish (they usually fail on their own, naming
    the lost rank), then SIGTERM, then SIGKILL; the first failure's code is returned. Ctrl-C is
    forwarded; ``timeout`` (seconds) stops everything and returns 124.

    Network testbed hooks: ``prefix(rank)`` is prepended to rank's command line (e.g.
    ``["ip", "netns", "exec", f"h{rank}"]``); for ``mpi`` it goes into a small wrapper script that
    mpirun runs and that picks the prefix by ``$OMPI_COMM_WORLD_RANK``. ``bind_addrs[rank]`` is the
    address rank should use: Gloo binds to its interface (``GRADZIP_BIND_ADDR``), MPI is restricted
    to TCP (no shared memory, which would bypass an emulated link) on those addresses.
    ``mpi_args`` are extra mpirun arguments.

    ``rank_env(rank)``: variables for that rank alone, set last (so they override the ones above,
    e.g. LOCAL_RANK and LOCAL_WORLD_SIZE when several ranks share an emulated host). Not with
    ``mpi``, where mpirun sets each rank's environment.
    """
    if workers < 1:
        raise GradzipError(f"--workers must be >= 1, got {workers}")
    if bind_addrs is not None and len(bind_addrs) != workers:
        raise GradzipError(f"bind_addrs has {len(bind_addrs)} addresses for {workers} workers")
    b = backend.lower()
    if b not in BACKENDS:
        raise GradzipError(f"spawn_local: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if rank_env is not None and b == "mpi":
        raise GradzipError("spawn_local: rank_env does not work with backend mpi (mpirun sets each rank's environment)")
    base = dict(os.environ)
    quiet_torch_logs(base)
    base.update(env_extra or {})
    base.setdefault("OMP_NUM_THREADS", "1")  # N ranks on one host: one BLAS thread each
    base["GRADZIP_LAUNCHER"] = "spawn_local"
    for k in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID"):
        base.pop(k, None)
    if b == "mpi":
        return _spawn_mpi(workers, argv, base, env_extra or {}, timeout, bind_addrs, prefix, module, grace,
                          mpi_args)
    addr = bind_addrs[0] if bind_addrs else "127.0.0.1"
    port = int(env_extra["MASTER_PORT"]) if env_extra and "MASTER_PORT" in env_extra else _port_for(addr)
    procs = []
    try:
        for r in range(workers):
            env = dict(base, RANK=str(r), WORLD_SIZE=str(workers), LOCAL_RANK=str(r),
                       LOCAL_WORLD_SIZE=str(workers), MASTER_ADDR=addr, MASTER_PORT=str(port))
            if bind_addrs:
                env["GRADZIP_BIND_ADDR"] = bind_addrs[r]
            if rank_env is not None:
                env.update(rank_env(r))
            cmd = [*(prefix(r) if prefix else []), sys.executable, "-m", module, *argv]
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    except BaseException:
        _terminate(procs)
        raise
    return supervise(procs, [f"rank {r}" for r in range(workers)], timeout, grace)


def _port_for(addr: str) -> int:
    try:
        return free_port(addr)
    except OSError:  # the address lives in another network namespace: any port is free there
        return free_port()


def find_mpirun() -> str:
    """The mpirun next to the running Python (a venv with the Open MPI wheel), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(here, os.X_OK):
        return here
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if found is None:
        raise GradzipError("mpirun not found next to the Python interpreter or on PATH: "
                           "pip install 'gradzip[mpi]' (mpi4py and the Open MPI wheel)")
    return found


def _is_open_mpi(mpirun: str) -> bool:
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out or "prte" in out.lower()


def _spawn_mpi(workers: int, argv: Sequence[str], env: dict[str, str], extra: Mapping[str, str],
               timeout: float | None, bind_addrs: Sequence[str] | None, prefix: Callable[[int], Sequence[str]] | None,
               module: str, grace: float, mpi_args: Sequence[str]) -> int:
    mpirun = find_mpirun()
    cmd = [mpirun, "-n", str(workers)]
    if _is_open_mpi(mpirun):
        cmd += ["--oversubscribe", "--bind-to", "none"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if prefix is not None or bind_addrs:  # force traffic through the (emulated) network
            cmd += ["--mca", "btl", "self,tcp", "--mca", "pml", "ob1"]
        if bind_addrs:
            cmd += ["--mca", "btl_tcp_if_include", ",".join(f"{a}/32" for a in bind_addrs)]
        for k in sorted({*extra, "OMP_NUM_THREADS"}):
            cmd += ["-x", k]
    cmd += list(mpi_args)
    program = [sys.executable, "-m", "mpi4py", "-m", module, *argv]
    with tempfile.TemporaryDirectory(prefix="gradzip-mpi-") as tmp:
        if prefix is not None:
            wrapper = os.path.join(tmp, "rank_prefix.sh")
            cases = "".join(f"  {r}) exec {shlex.join(prefix(r))} \"$@\" ;;\n" for r in range(workers))
            with open(wrapper, "w") as f:
                f.write("#!/bin/sh\n# gradzip spawn_local: per-rank command prefix\n"
                        f"case \"${{OMPI_COMM_WORLD_RANK:-$PMI_RANK}}\" in\n{cases}esac\n"
                        "echo \"gradzip: no prefix for this rank\" >&2; exit 1\n")
            program = ["/bin/sh", wrapper, *program]
        proc = subprocess.Popen(cmd + program, env=env, start_new_session=True)
        return supervise([proc], ["mpirun"], timeout, grace)


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal s -> 128 + s, as a shell reports it


def supervise(procs: list[subprocess.Popen], names: list[str], timeout: float | None, grace: float) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    first: tuple[str, int] | None = None
    stop_at: float | None = None
    old = None
    if _main_thread():  # SIGTERM (Slurm, a CI timeout) stops the children too
        old = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        while True:
            codes = [p.poll() for p in procs]
            for name, c in zip(names, codes):
                if first is None and c not in (None, 0):
                    first = (name, _exit_code(c))
                    if any(x is None for x in codes):
                        sys.stderr.write(f"gradzip: {name} exited with code {first[1]}; stopping the other "
                                         f"ranks in {grace:g} s\n")
                        stop_at = time.monotonic() + grace
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if stop_at is not None and now > stop_at:
                _terminate(procs)
                break
            if deadline is not None and now > deadline:
                sys.stderr.write(f"gradzip: workers still running after {timeout:g} s; stopping them\n")
                _terminate(procs)
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        sys.stderr.write("gradzip: interrupted; stopping the workers\n")
        _signal_all(procs, signal.SIGINT)
        _wait_all(procs, grace)
        _terminate(procs)
        return 130
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    if first is not None:
        return first[1]
    return next((_exit_code(p.returncode) for p in procs if p.returncode), 0)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _signal_all(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _wait_all(procs: list[subprocess.Popen], seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        time.sleep(0.05)


def _terminate(procs: list[subprocess.Popen]) -> None:
    """SIGTERM (and SIGCONT, for stopped ranks) to each child's process group, SIGKILL after 5 s."""
    _signal_all(procs, signal.SIGTERM)
    _signal_all(procs, signal.SIGCONT)
    _wait_all(procs, 5.0)
    _signal_all(procs, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
