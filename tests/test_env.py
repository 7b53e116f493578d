"""``gradzip env``: the report has every line a bug report needs."""

from __future__ import annotations

import importlib.util
import re

import torch

from gradzip.cli import main


def test_env_prints_versions_backends_and_hardware(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert not re.search(r"[\x00-\x08\x0b-\x1f]", out), "a control character (Open MPI's trailing NUL) in the report"
    # "key<padding>  value": keys may hold one space ("mpi library"), the padding is two or more
    lines = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in out.splitlines() if line.strip())
    for key in ("gradzip", "python", "torch", "nccl", "mpi4py", "mpi library", "tokenizers", "backends", "cpu",
                "gpu"):
        assert key in lines, f"missing {key!r} in:\n{out}"
    assert lines["torch"] == torch.__version__
    backends = [b.strip() for b in lines["backends"].split(",")]
    assert backends[0] == "sim"
    assert ("gloo" in backends) == torch.distributed.is_gloo_available()
    assert ("nccl" in backends) == (torch.cuda.is_available() and torch.distributed.is_nccl_available())
    if importlib.util.find_spec("mpi4py") is None:
        assert lines["mpi4py"] == "not installed" and "mpi" not in backends
    else:
        import mpi4py

        assert lines["mpi4py"] == mpi4py.__version__
        assert "not available" not in lines["mpi library"]
    if not torch.cuda.is_available():
        assert lines["gpu"] == "none"
    from gradzip.compress import native

    assert lines["native kernels"] == ("in use" if native.lib() is not None else native.status().split(": ", 1)[1])
