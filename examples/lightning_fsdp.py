"""Lightning + FSDP2 + gradzip: `ModelParallelStrategy`, sharded in `configure_model()`. BERT (masked LM).

    python examples/lightning_fsdp.py --compressor topk:ratio=0.1,ef=true --out runs/lightning-fsdp

Lightning starts the 2 CPU processes itself. `configure_model()` applies `fully_shard` over the
strategy's data-parallel mesh and attaches gradzip right after, before the first backward; the
module logs the `gradzip/` figures through `self.log`, so they reach every Lightning logger.
"""

import argparse
import os

import torch
from torch.distributed.fsdp import fully_shard

import gradzip
from gradzip.comm.cost import reduce_scatter_bytes
from gradzip.engine.fsdp import FSDPCompression
from gradzip.integrations import exit_if_missing

with exit_if_missing("examples/lightning_fsdp.py", "lightning"):  # without the extra: one line, exit code 2
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import ModelParallelStrategy
    from toy_mlm import Patterns, tiny_bert


class MaskedLM(L.LightningModule):
    def __init__(self, spec: str) -> None:
        super().__init__()
        self.bert = tiny_bert()
        self.spec = spec
        self.comp: FSDPCompression | None = None
        self.fp32_bytes = 4 * sum(p.numel() for p in self.bert.parameters())  # before sharding: the whole model
        self.sent = 0  # comp.bytes_sent at the last step

    def configure_model(self) -> None:
        if self.comp is not None:  # Lightning may call it again (validate after fit): sharded already
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.bert.bert.encoder.layer:  # one FSDP unit per encoder layer, then the root
            fully_shard(layer, mesh=mesh)
        fully_shard(self.bert, mesh=mesh)  # the root keeps the tied embeddings and decoder together
        self.comp = gradzip.fsdp_compress(self, self.spec)  # every rank, before the first backward

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.bert(**batch).loss
        self.log("loss", loss, on_step=True)
        return loss

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        assert self.comp is not None
        sent, self.sent = self.comp.bytes_sent - self.sent, self.comp.bytes_sent  # this step's bytes
        fp32 = reduce_scatter_bytes(self.fp32_bytes, self.device_mesh["data_parallel"].size())
        self.log("gradzip/bytes_per_step", float(sent), on_step=True)  # this rank's (rank 0's in the logs)
        self.log("gradzip/compression_ratio", fp32 / max(sent, 1), on_step=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=2e-3)  # after configure_model: over the shards


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compressor", default="topk:ratio=0.1,ef=true")
    ap.add_argument("--out", default="runs/lightning-fsdp")
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()

    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=a.steps, default_root_dir=a.out, log_every_n_steps=1,
        logger=CSVLogger(a.out),  # lightning_logs/version_N/metrics.csv; any Lightning logger works
        # FSDP over both processes: a data-parallel mesh of 2 (the default puts them in tensor parallel)
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    model = MaskedLM(a.compressor)
    loader = torch.utils.data.DataLoader(Patterns(), batch_size=8, shuffle=False)
    trainer.fit(model, loader)
    assert model.comp is not None
    os.makedirs(a.out, exist_ok=True)
    torch.save(model.comp.state_dict(), f"{a.out}/gradzip-rank{trainer.global_rank}.pt")  # error memory, per rank
    model.comp.remove()


if __name__ == "__main__":
    main()
