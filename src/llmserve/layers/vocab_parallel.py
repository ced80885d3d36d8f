"""Vocab-parallel embedding and LM head (Megatron-LM; vLLM's ``VocabParallelEmbedding``
/ ``ParallelLMHead``): the vocabulary is cut into ``tp`` equal ranges (the last one
padded with zero rows when ``tp`` does not divide it)::

    vocab 49152, tp=3:  rank 0 rows 0..16383 | rank 1 16384..32767 | rank 2 32768..49151

    embedding: each rank looks up the ids in its range (zeros elsewhere), all-reduce
    LM head:   each rank computes logits for its range, all-gather -> [N, vocab]

Each layer loads its own rows of the full checkpoint tensor (a GGUF tensor stays
quantized: whole byte rows), so a tied LM head can still run the packed kernel on
the local rows (``GGUFNativeConfig.process_model``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.distributed.parallel_state import GroupCoordinator
from llmserve.layers.linear import Linear, default_weight_loader
from llmserve.layers.parallel_linear import narrow_weight
from llmserve.layers.quantization.base import QuantizedTensor


def vocab_range(vocab_size: int, tp: GroupCoordinator) -> tuple[int, int, int]:
    """``(rows per rank, first id of this rank, ids this rank really holds)``."""
    per = -(-vocab_size // tp.world_size)
    start = tp.rank_in_group * per
    return per, start, max(0, min(per, vocab_size - start))


def _load_rows(param: nn.Parameter, loaded, start: int, num_local: int) -> None:
    shard = narrow_weight(loaded, 0, start, num_local)
    if num_local == param.shape[0]:
        default_weight_loader(param, shard)  # keeps a QuantizedTensor's source
        return
    dense = shard.dequantize() if isinstance(shard, QuantizedTensor) else shard
    with torch.no_grad():
        param.data.zero_()
        param.data[:num_local].copy_(dense)


class VocabParallelEmbedding(nn.Embedding):
    """``ids [T] -> [T, hidden]``; this rank's table is ``weight [vocab / tp, hidden]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype,
                 tp: GroupCoordinator) -> None:
        per, start, num_local = vocab_range(num_embeddings, tp)
        super().__init__(per, embedding_dim, dtype=dtype)
        self.weight.requires_grad_(False)
        self.tp, self.org_vocab_size = tp, num_embeddings
        self.vocab_start, self.num_local = start, num_local

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        """Load rows ``vocab_start .. vocab_start + num_local`` of the full table."""
        _load_rows(param, loaded_weight, self.vocab_start, self.num_local)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(Linear):
    """An untied LM head: this rank's logits ``[N, vocab / tp]`` (gathered by the model
    wrapper, :func:`llmserve.models.tensor_parallel.parallelize_model`)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tp: GroupCoordinator) -> None:
        per, start, num_local = vocab_range(vocab_size, tp)
        super().__init__(hidden_size, per, bias=False, dtype=dtype)
        self.tp, self.org_vocab_size = tp, vocab_size
        self.vocab_start, self.num_local = start, num_local

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        """Load this rank's vocab rows of the full ``[vocab, hidden]`` weight."""
        shard = narrow_weight(loaded_weight, 0, self.vocab_start, self.num_local)
        if self.num_local < self.output_size:  # the padded last range runs dense
            dense = shard.dequantize() if isinstance(shard, QuantizedTensor) else shard
            shard = torch.cat([dense.to(self.weight.dtype), torch.zeros(
                self.output_size - self.num_local, self.input_size, dtype=self.weight.dtype)])
        super().weight_loader(param, shard, None)


def gather_logits(local_logits: torch.Tensor, vocab_size: int,
                  tp: GroupCoordinator) -> torch.Tensor:
    """``[N, vocab / tp]`` on every rank -> ``[N, vocab]`` (padding dropped)."""
    full = tp.all_gather(local_logits, dim=-1)
    return full if full.shape[-1] == vocab_size else full[..., :vocab_size].contiguous()
