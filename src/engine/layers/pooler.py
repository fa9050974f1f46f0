"""Pooler: the hidden states of each input -> one embedding vector (embedding models).

An extend batch holds every request's tokens back to back (`extend_start_loc`,
`extend_seq_lens`). The pooled vector is the last token's hidden state (decoders), the first
token's (CLS), or the mean over the input's tokens; then, per request, the `dimensions` it asked
for are kept (Matryoshka truncation) and the vector is L2-normalised when the model says so.
Pooling runs in float32 whatever the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from engine.configs.pooling_config import PoolingType

if TYPE_CHECKING:
    from engine.model_executor.forward_batch_info import ForwardBatch


@dataclass
class EmbeddingPoolerOutput:
    # [bs, hidden] float32, or one vector per request when requests kept different dimensions.
    embeddings: Union[torch.Tensor, List[torch.Tensor]]


def pool_hidden_states(pooling_type: PoolingType, hidden_states: torch.Tensor,
                       forward_batch: "ForwardBatch") -> torch.Tensor:
    """[num_tokens, hidden] -> [bs, hidden] float32, one row per request of the batch."""
    starts = forward_batch.extend_start_loc
    lens = forward_batch.extend_seq_lens
    assert starts is not None and lens is not None  # embeddings pool extends; init_new sets both
    if pooling_type == PoolingType.LAST:
        return hidden_states.index_select(0, starts + lens - 1).float()
    if pooling_type == PoolingType.CLS:
        return hidden_states.index_select(0, starts).float()
    if pooling_type == PoolingType.MEAN:
        bs = lens.shape[0]
        owner = torch.repeat_interleave(torch.arange(bs, device=hidden_states.device), lens,
                                        output_size=hidden_states.shape[0])
        sums = torch.zeros((bs, hidden_states.shape[-1]), dtype=torch.float32, device=hidden_states.device)
        sums.index_add_(0, owner, hidden_states.float())
        return sums / lens.unsqueeze(1).to(torch.float32)
    raise ValueError(f"unsupported pooling type {pooling_type!r}")


class Pooler(nn.Module):
    def __init__(self, pooling_type: PoolingType, normalize: bool) -> None:
        super().__init__()
        self.pooling_type = pooling_type
        self.normalize = normalize

    def forward(self, hidden_states: torch.Tensor, forward_batch: "ForwardBatch") -> EmbeddingPoolerOutput:
        pooled = pool_hidden_states(self.pooling_type, hidden_states, forward_batch)
        dims: Optional[List[Optional[int]]] = forward_batch.dimensions
        if dims is None or all(d is None for d in dims):
            return EmbeddingPoolerOutput(self._finish(pooled))
        if len(set(dims)) == 1:
            return EmbeddingPoolerOutput(self._finish(pooled[:, : dims[0]]))
        # Truncate before normalising: the kept prefix must be a unit vector on its own.
        return EmbeddingPoolerOutput([self._finish(row[:dim] if dim is not None else row)
                                      for row, dim in zip(pooled, dims)])

    def _finish(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, p=2, dim=-1) if self.normalize else x
