"""The progress output of ``gradzip train`` (rank 0 only): a bar on a terminal, plain lines in logs."""

from __future__ import annotations

import os
from typing import IO

from gradzip.data.progress import progress_bar
from gradzip.training.metrics import StepRecord


class Progress:
    """Step/total, loss, tokens/s and MB sent per step on rank 0: a tqdm bar when stderr is a
    terminal, else a plain line every 10% of the steps or 30 s (a Slurm log, a sweep's ``logs/``).
    Nothing elsewhere, or with ``--no-progress`` or ``GRADZIP_NO_PROGRESS=1``."""

    def __init__(self, enabled: bool, total: int, initial: int, file: IO[str] | None = None) -> None:
        self.bar = None
        if enabled and not os.environ.get("GRADZIP_NO_PROGRESS"):
            self.bar = progress_bar(total=total, initial=initial, unit="step", dynamic_ncols=True, desc="train",
                                    file=file)

    def update(self, rec: StepRecord, step_tokens: float) -> None:
        if self.bar is None:
            return
        tok_s = step_tokens / rec.step_s if rec.step_s else 0.0
        post = {"loss": f"{rec.loss:.3f}", "tok/s": f"{tok_s:,.0f}", "MB/step": f"{rec.bytes_sent / 1e6:.2f}"}
        if rec.eval_loss is not None:
            post["eval"] = f"{rec.eval_loss:.3f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
