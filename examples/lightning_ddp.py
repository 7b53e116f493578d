"""Lightning + gradzip through Lightning's documented comm-hook path: BERT (masked LM).

    python examples/lightning_ddp.py --compressor onebit --out runs/lightning

Lightning starts the 2 CPU processes itself. `gradzip.ddp_hook` is called before any process
group exists (the state binds at the hook's first call); the callback logs the `gradzip/` figures
and keeps every rank's error memory in Lightning's checkpoints.
"""

import argparse

import torch

import gradzip
from gradzip.integrations import exit_if_missing

with exit_if_missing("examples/lightning_ddp.py", "lightning"):  # without the extra: one line, exit code 2
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy
    from toy_mlm import Patterns, save_replica, tiny_bert

    from gradzip.integrations.lightning import GradzipCallback


class MaskedLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.bert = tiny_bert()

    def training_step(self, batch, batch_idx):
        loss = self.bert(**batch).loss
        self.log("loss", loss, on_step=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=2e-3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compressor", default="onebit")
    ap.add_argument("--out", default="runs/lightning")
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()

    state, hook = gradzip.ddp_hook(a.compressor)  # no process group yet: it binds at the first step
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=a.steps, default_root_dir=a.out, log_every_n_steps=1,
        logger=CSVLogger(a.out),  # lightning_logs/version_N/metrics.csv; any Lightning logger works
        strategy=DDPStrategy(process_group_backend="gloo", ddp_comm_state=state, ddp_comm_hook=hook),
        callbacks=[GradzipCallback(state)], enable_progress_bar=False, enable_model_summary=False,
    )
    model = MaskedLM()
    loader = torch.utils.data.DataLoader(Patterns(), batch_size=8, shuffle=False)
    trainer.fit(model, loader)
    save_replica(model, a.out, trainer.global_rank)


if __name__ == "__main__":
    main()
