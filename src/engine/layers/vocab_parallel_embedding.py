"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded to a multiple of `tp_size * 64` and split into equal contiguous ranges;
rank r owns ids [r * per_rank, (r + 1) * per_rank). Padding rows are zero and their logits are
sliced away by the LogitsProcessor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from engine.layers.quantization import quantize_weight
from engine.model_loader.weight_utils import ShardId, set_weight_loader

if TYPE_CHECKING:  # layers.linear imports the loader package, which must not import the model's layers back
    from engine.layers.linear import PackedWeight

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int) -> int:
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, padding_size: int = DEFAULT_VOCAB_PADDING_SIZE) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.num_embeddings = num_embeddings  # the real vocabulary size
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size * self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if loaded_weight.shape[0] != self.num_embeddings or loaded_weight.shape[1] != self.embedding_dim:
            raise ValueError(
                f"embedding shape mismatch: checkpoint {tuple(loaded_weight.shape)}, "
                f"expected ({self.num_embeddings}, {self.embedding_dim})"
            )
        self.load_vocab_rows(param, loaded_weight)

    def load_vocab_rows(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        """This rank's vocabulary rows of a tensor with one row per token (the weight, or a quantized head's
        codes, scales and zeros), the padding rows zero."""
        if loaded_weight.shape[0] != self.num_embeddings or loaded_weight.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded_weight.shape)}, expected "
                             f"({self.num_embeddings}, {', '.join(str(d) for d in param.shape[1:])})")
        start = self.vocab_start_index
        end = min(self.vocab_end_index, self.num_embeddings)
        rows = max(0, end - start)
        param.data.zero_()
        if rows:
            param.data[:rows].copy_(loaded_weight[start:end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids owned by other ranks look up row 0 and are zeroed; the all-reduce fills them in.
        mask = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index) * mask
        out = F.embedding(local_ids, self.weight)
        out = out * mask.unsqueeze(-1).to(out.dtype)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; holds this rank's vocabulary rows. The LogitsProcessor does the
    matmul, the all-gather and the slice to the real vocabulary size."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_size: int = DEFAULT_VOCAB_PADDING_SIZE) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_size)
        # engine.layers.linear.prepack_linear_weights's copy, or the quantized head (a GPTQ checkpoint's
        # lm_head, --quantize-lm-head): then the only one, `weight` empty unless tied to the embedding.
        self.packed_weight: Optional[PackedWeight] = None

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> None:
        """Share the embedding matrix (tie_word_embeddings)."""
        self.weight = embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - misuse guard
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called directly")


def quantize_lm_head(model: nn.Module, method: str) -> int:
    """--quantize-lm-head: each LM head's rows (this rank's vocabulary slice) quantized per row as the linears
    are; the number of heads done. An untied head's float rows are released; a head tied to the embedding keeps
    them, since the embedding reads the same matrix and stays float (the int8 copy adds one byte a weight)."""
    embeddings = {id(m.weight) for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    count = 0
    for module in model.modules():
        if not isinstance(module, ParallelLMHead) or module.weight.numel() == 0:
            continue
        module.packed_weight = quantize_weight(module.weight.data, method)
        if id(module.weight) not in embeddings:
            module.weight = nn.Parameter(torch.empty(0, dtype=module.weight.dtype, device=module.weight.device),
                                         requires_grad=False)
        count += 1
    return count
