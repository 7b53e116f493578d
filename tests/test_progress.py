"""Progress output: a tqdm bar only on a terminal; into a log (Slurm, a sweep's logs/, a pipe) a
plain line every 10% of the total or every 30 s, without ``\\r``; nothing when disabled."""

from __future__ import annotations

import io

import pytest

import gradzip.data.progress as progress_mod
from gradzip.data.progress import PlainProgress, is_terminal, progress_bar
from gradzip.training.metrics import StepRecord
from gradzip.training.progress import Progress


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def _record(step: int, eval_loss: float | None = None) -> StepRecord:
    return StepRecord(step=step, loss=7.25, mlm_loss=6.5, nsp_loss=0.7, lr=1e-3, tokens=4096 * step, samples=64 * step,
                      step_s=0.1, wall_s=0.1 * step, compute_s=0.05, compress_s=0.0, comm_s=0.05, opt_s=0.0,
                      bytes_sent=9_317_000, bytes_recv=9_317_000, grad_norm=1.0, clock="modelled", host_s=0.1,
                      eval_loss=eval_loss)


def _train(stream: io.StringIO, total: int = 200, enabled: bool = True, initial: int = 0) -> str:
    bar = Progress(enabled, total=total, initial=initial, file=stream)
    for s in range(initial + 1, total + 1):
        bar.update(_record(s, eval_loss=7.3 if s % 50 == 0 else None), step_tokens=4096)
    bar.close()
    return stream.getvalue()


@pytest.fixture(autouse=True)
def _progress_on(monkeypatch):
    monkeypatch.delenv("GRADZIP_NO_PROGRESS", raising=False)  # conftest turns it off for the suite


def test_train_into_a_log_prints_a_few_plain_lines():
    out = _train(io.StringIO())
    assert "\r" not in out and "\x1b" not in out
    lines = out.splitlines()
    assert 10 <= len(lines) <= 11, lines  # every 10% of 200 steps (+ none extra: the last is at 100%)
    assert lines[0].startswith("train: 20/200 step (10%)") and lines[-1].startswith("train: 200/200 step (100%)")
    for line in lines:
        assert "loss=7.250" in line and "tok/s=40,960" in line and "MB/step=9.32" in line


def test_train_on_a_terminal_draws_the_bar():
    out = _train(FakeTTY())
    assert "\r" in out and "200/200" in out and "MB/step=9.32" in out


@pytest.mark.parametrize("stream", [io.StringIO, FakeTTY])
def test_train_disabled_prints_nothing(stream, monkeypatch):
    assert _train(stream(), enabled=False) == ""
    monkeypatch.setenv("GRADZIP_NO_PROGRESS", "1")
    assert _train(stream()) == ""


def test_resumed_run_counts_from_its_step():
    lines = _train(io.StringIO(), total=200, initial=100).splitlines()
    assert 10 <= len(lines) <= 11 and lines[0].startswith("train: 110/200 step (55%)")


def test_plain_lines_every_30_seconds_between_the_tenths(monkeypatch):
    clock = iter(range(0, 10_000, 31))  # 31 s per call: each update is past the 30 s mark
    monkeypatch.setattr(progress_mod.time, "monotonic", lambda: float(next(clock)))
    buf = io.StringIO()
    bar = PlainProgress(total=1000, desc="x", unit="doc", file=buf)
    for _ in range(5):
        bar.update(1)
    bar.close()
    assert len(buf.getvalue().splitlines()) == 5  # a line per update, none added by close


def test_data_bars_follow_the_stream():
    buf = io.StringIO()
    assert list(progress_bar(range(50), desc="building examples", unit="doc", file=buf)) == list(range(50))
    lines = buf.getvalue().splitlines()
    assert "\r" not in buf.getvalue() and len(lines) == 10 and lines[-1].startswith("building examples: 50/50 doc")
    tty = FakeTTY()
    assert sum(1 for _ in progress_bar(range(50), desc="building examples", file=tty)) == 50
    assert "\r" in tty.getvalue()
    quiet = io.StringIO()
    bar = progress_bar(total=10, desc="x", disable=True, file=quiet)
    bar.update(10)
    bar.close()
    assert quiet.getvalue() == ""


def test_is_terminal_of_odd_streams():
    closed = io.StringIO()
    closed.close()
    assert not is_terminal(None) and not is_terminal(closed) and not is_terminal(io.StringIO())
    assert is_terminal(FakeTTY())
