"""accelerate + FSDP2 + gradzip: shard with `fully_shard`, then compress its reduce-scatter. BERT (masked LM).

    torchrun --nproc-per-node 2 examples/accelerate_fsdp.py --compressor topk:ratio=0.1,ef=true --out runs/acc-fsdp

accelerate 1.16 applies its FSDP2 plugin only on accelerators: on CPU it wraps the model in DDP
(with `cpu=True`) or trains undistributed, without a word. So the model is sharded here with
`fully_shard` by hand, and accelerate prepares the optimizer and the data loader only. On GPUs
with `FullyShardedDataParallelPlugin(fsdp_version=2)`, `accelerator.prepare(model, ...)` shards
instead, and `gradzip.fsdp_compress` goes on the model it returns, the same call.
"""

import argparse
import os

import torch
from torch.distributed.fsdp import fully_shard

import gradzip
from gradzip.comm.cost import reduce_scatter_bytes
from gradzip.integrations import exit_if_missing

with exit_if_missing("examples/accelerate_fsdp.py", "hf"):  # without the extra: one line, exit code 2
    from accelerate import Accelerator
    from toy_mlm import Patterns, tiny_bert


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compressor", default="topk:ratio=0.1,ef=true")
    ap.add_argument("--out", default="runs/acc-fsdp")
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()

    accelerator = Accelerator(cpu=True)  # the process group (gloo), the device, the data sharding
    model = tiny_bert()
    n_params = sum(p.numel() for p in model.parameters())
    for layer in model.bert.encoder.layer:  # one FSDP unit per encoder layer, then the root
        fully_shard(layer)
    fully_shard(model)  # the root keeps the tied embeddings and decoder together
    comp = gradzip.fsdp_compress(model, a.compressor)  # every rank, before the first backward
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)  # after fully_shard: over the shards
    loader = torch.utils.data.DataLoader(Patterns(), batch_size=8, shuffle=False)
    optimizer, loader = accelerator.prepare(optimizer, loader)  # not the model: it would become DDP

    losses: list[float] = []
    while len(losses) < a.steps:  # epochs until --steps
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)  # FSDP's reduce-scatter runs through gradzip here
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if len(losses) == a.steps:
                break
    fp32 = a.steps * reduce_scatter_bytes(4 * n_params, accelerator.num_processes)  # uncompressed FSDP
    figures = {"steps": a.steps, "bytes_per_step": comp.bytes_sent / a.steps,
               "compression_ratio": fp32 / max(comp.bytes_sent, 1),
               "reduce_s_per_step": comp.reduce_s / a.steps, "collectives": comp.stats}
    accelerator.print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; gradzip: {figures}")
    os.makedirs(a.out, exist_ok=True)
    rank = accelerator.process_index
    torch.save({"losses": losses, "figures": figures}, f"{a.out}/losses-rank{rank}.pt")
    torch.save(comp.state_dict(), f"{a.out}/gradzip-rank{rank}.pt")  # each rank's error memory: save per rank
    comp.remove()


if __name__ == "__main__":
    main()
