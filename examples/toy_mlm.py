"""The toy masked-LM task the trainer examples share: a random BERT built from a config and a
synthetic corpus, so that every example runs anywhere without a download. Replace both with your
own model and dataset; nothing gradzip-specific is here."""

import torch
from transformers import BertConfig, BertForMaskedLM

MASK_ID = 4


class Patterns(torch.utils.data.Dataset):
    """Sequences that repeat a short random motif of 8 frequent tokens, 15% of tokens masked:
    the loss falls fast (token frequencies), then further (the motif, from context)."""

    def __init__(self, n: int = 256, length: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        motifs = torch.randint(5, 13, (n, 4), generator=g)
        self.ids = motifs.repeat(1, length // 4)
        self.mask = torch.rand(self.ids.shape, generator=g) < 0.15

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        labels = torch.where(self.mask[i], self.ids[i], -100)
        return {"input_ids": torch.where(self.mask[i], MASK_ID, self.ids[i]), "labels": labels}


def tiny_bert(seed: int = 0) -> BertForMaskedLM:
    """A 2-layer BERT for masked LM (about 0.1M parameters), the same on every rank."""
    config = BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(seed)
    return BertForMaskedLM(config)


def save_replica(model: torch.nn.Module, out: str, rank: int) -> None:
    """Each rank's parameters after training: with a correct exchange the replicas are identical."""
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, f"{out}/replica-rank{rank}.pt")
