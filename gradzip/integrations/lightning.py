"""gradzip in Lightning: its documented comm-hook path, plus a callback for figures and checkpoints.

    state, hook = gradzip.ddp_hook("onebit")     # before any process group exists: binds late
    trainer = L.Trainer(accelerator="cpu", devices=2,
                        strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook),
                        callbacks=[GradzipCallback(state)])

:class:`GradzipCallback`

- logs this rank's figures after every training batch through ``LightningModule.log`` under
  ``gradzip/`` keys (``gradzip/bytes_per_step``, ``gradzip/compression_ratio``,
  ``gradzip/compress_s_per_step``), so they reach every Lightning logger;
- registers the hook itself where Lightning does not: ``DDPStrategy`` registers comm hooks only
  when its root device is CUDA, and on CPU (gloo) silently trains uncompressed; the callback then
  registers the same hook at ``on_fit_start``, before the first step;
- keeps the hook state (error memory, PowerSGD's Q) in Lightning's checkpoints. Lightning writes a
  checkpoint from rank 0 only, while every rank's error memory is its own: on save the callback
  gathers every rank's state into the checkpoint, and on load each rank takes its own back.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradzip.engine.ddp import GradzipHookState, gradzip_comm_hook
from gradzip.errors import GradzipError
from gradzip.integrations import check_state, log_figures, missing_extra

try:
    from lightning.pytorch import Callback
except ModuleNotFoundError as e:
    raise missing_extra("gradzip.integrations.lightning", e, "lightning") from None

__all__ = ["GradzipCallback"]

KEY = "gradzip"  # the entry of Lightning's checkpoint dict


class GradzipCallback(Callback):
    """Figures and checkpoints of the hook whose ``state`` :func:`gradzip.ddp_hook` returned."""

    def __init__(self, state: GradzipHookState) -> None:
        if not isinstance(state, GradzipHookState):
            raise GradzipError("GradzipCallback(state): pass the state that gradzip.ddp_hook(spec) returned")
        self.hook_state = state

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        ddp = getattr(trainer.strategy, "model", None)
        if not isinstance(ddp, DistributedDataParallel):
            if trainer.world_size > 1:
                raise GradzipError(f"GradzipCallback: the strategy's model is a {type(ddp).__name__}, not "
                                   "DistributedDataParallel; use DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)")
            warnings.warn("GradzipCallback: a single process has no gradient exchange to compress; "
                          "training goes on uncompressed", stacklevel=2)
            return
        if not any(state is self.hook_state for _, state in getattr(ddp, "_comm_hooks", [])):
            ddp.register_comm_hook(self.hook_state, gradzip_comm_hook)  # Lightning skipped it (CPU)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        figures = log_figures(self.hook_state)
        if figures:
            pl_module.log_dict(figures, on_step=True, on_epoch=False, sync_dist=False, rank_zero_only=False)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # Every rank runs this hook (Lightning writes the file from rank 0): gather all ranks' states.
        mine = self.hook_state.state_dict()
        if dist.is_initialized() and dist.get_world_size() > 1:
            states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(states, mine)
        else:
            states = [mine]
        checkpoint[KEY] = {"ranks": states}

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        entry = checkpoint.get(KEY)
        if entry is None:
            return  # a checkpoint from before gradzip: the error memory starts from zero
        rank = dist.get_rank() if dist.is_initialized() else 0
        states = entry.get("ranks", [])
        if rank >= len(states):
            raise GradzipError(f"the checkpoint holds gradzip state for {len(states)} ranks, not rank {rank}; "
                               "resume with the same number of processes")
        self.hook_state.load_state_dict(check_state(states[rank], f"the checkpoint's gradzip state of rank {rank}"))
