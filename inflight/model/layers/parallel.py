"""Tensor parallelism inside the model (Megatron's split): which slice of each weight a rank
holds, and the collectives that join the slices.

Each of N ranks holds 1/N of the attention heads and of the MLP's intermediate width: q/k/v and
gate/up are split by output rows (column-parallel), o_proj and down_proj by input columns
(row-parallel) and followed by an all-reduce. With fewer KV heads than ranks, each rank holds a
copy of the one KV head its query heads read. The embedding and the LM head are split by
vocabulary rows: a rank embeds the tokens of its rows (the others give zeros) before an
all-reduce, and the head's slices are gathered into whole logits. Norms are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from inflight.model.config import ModelConfig


@dataclass
class TensorParallel:
    """This process's rank among `size`; `group` (a torch.distributed process group over the
    ranks) is connected once every rank has loaded its shard."""

    rank: int
    size: int
    group: Any = None

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The decoder layers' shape on this rank."""
        return replace(
            config,
            num_heads=config.num_heads // self.size,
            num_kv_heads=max(1, config.num_kv_heads // self.size),
            intermediate_size=config.intermediate_size // self.size,
        )

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """The [start, end) rows of the (padded) vocabulary this rank holds."""
        per_rank = -(-vocab_size // self.size)
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def shard(self, name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        """This rank's slice of checkpoint tensor `name` (Hugging Face names, `model.` gone)."""
        parts = name.split(".")
        kind, leaf = (parts[-2], parts[-1]) if len(parts) > 1 else ("", parts[0])
        hd, local = config.head_dim, self.local_config(config)
        if kind == "q_proj":
            return _rows(tensor, self.rank * local.num_heads * hd, local.num_heads * hd)
        if kind in ("k_proj", "v_proj"):
            # Replicated KV: the rank's query heads all read KV head rank // (size / kv).
            head = self.rank * config.num_kv_heads // self.size
            return _rows(tensor, head * hd, local.num_kv_heads * hd)
        if kind in ("gate_proj", "up_proj"):
            width = local.intermediate_size
            return _rows(tensor, self.rank * width, width)
        if kind in ("o_proj", "down_proj"):
            if leaf == "bias":  # added once, after the all-reduce sums the ranks' outputs
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            width = local.num_heads * hd if kind == "o_proj" else local.intermediate_size
            return tensor[:, self.rank * width : (self.rank + 1) * width]
        if name in ("embed_tokens.weight", "lm_head.weight"):
            start, end = self.vocab_rows(config.vocab_size)
            rows = tensor[start:end]
            return F.pad(rows, (0, 0, 0, end - start - rows.shape[0]))  # the padding rows
        return tensor

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        self.group.allreduce([x]).wait()
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x`, in place on every rank."""
        self.group.broadcast(x, 0).wait()
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The whole logits [T, vocab] from every rank's slice of them [T, vocab / N]."""
        slices = [torch.empty_like(logits) for _ in range(self.size)]
        self.group.allgather([slices], [logits.contiguous()]).wait()
        return torch.cat(slices, dim=-1)[:, :vocab_size]


def _rows(tensor: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return tensor[start : start + count]


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; a token outside them embeds to zeros, and the
    all-reduce gives every rank the whole embedding."""

    def __init__(self, vocab_size: int, hidden: int, parallel: TensorParallel) -> None:
        super().__init__()
        self.start, end = parallel.vocab_rows(vocab_size)
        self.weight = nn.Parameter(torch.empty(end - self.start, hidden))
        self.parallel = parallel

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.parallel.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))
