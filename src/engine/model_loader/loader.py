"""Build a model from its config and fill it from the checkpoint, on the target device and dtype."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterable, Iterator, Optional, Protocol, Tuple, cast

import torch
from torch import nn

from engine.configs.mla_config import nextn_weight_prefix
from engine.configs.model_config import ModelConfig
from engine.layers.quant_config import CheckpointQuantization
from engine.model_loader.weight_utils import safetensors_weights_iterator
from engine.models.registry import resolve_model_class

logger = logging.getLogger(__name__)


class LoadableModel(Protocol):
    """Every model class of the registry loads its checkpoint itself."""

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None: ...


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def get_model(model_config: ModelConfig, device: str, dtype: torch.dtype,
              quantization: Optional[CheckpointQuantization] = None) -> nn.Module:
    """Construct the registered model class directly on `device` in `dtype` and load its weights;
    with `quantization` (a pre-quantized checkpoint) its linears load the quantized tensors
    (layers/prequantized.py), or a block-wise fp8 one's (layers/block_fp8.py).

    The rotary cos/sin cache is created in float32 on purpose and stays float32.
    """
    start = time.perf_counter()
    model_class = resolve_model_class(model_config.architectures)
    with _default_dtype(dtype), torch.device(device):
        model = model_class(model_config)
    # Buffers built with an explicit float32 dtype are left as they are. (The cast: torch types an
    # nn.Module's other attributes as Tensor | Module, so it cannot say the model has load_weights.)
    weights: Iterable[Tuple[str, torch.Tensor]] = safetensors_weights_iterator(
        model_config.model_path, nextn_weight_prefix(model_config.raw_config))
    if quantization is None:
        cast(LoadableModel, model).load_weights(weights)
    elif quantization.weights == "block_fp8":
        # Imported here, as prequantized below: layers.linear imports this package (its weight loaders).
        from engine.layers import block_fp8

        with torch.device(device):
            # The CPU kernel reads fp8 weights; elsewhere (the GPU) every weight is dequantized at load.
            fp8_plan = block_fp8.prepare(model, quantization, keep_fp8=device == "cpu")
        cast(LoadableModel, model).load_weights(block_fp8.checkpoint_tensors(weights, fp8_plan, dtype))
        block_fp8.finish(fp8_plan, dtype)
        logger.info("Loaded a block-wise fp8 checkpoint (blocks %s): %d linears kept in fp8, the other weights "
                    "dequantized to %s", list(quantization.block), len(fp8_plan.modules), str(dtype).replace("torch.", ""))
    else:
        # Imported here: layers.linear imports this package (its weight loaders).
        from engine.layers import prequantized

        with torch.device(device):
            plan = prequantized.prepare(model, quantization)
        cast(LoadableModel, model).load_weights(prequantized.canonical_weights(weights, plan))
        prequantized.finish(plan, dtype)
        logger.info("Loaded %d linear layers %s-quantized (%s weights)%s", len(plan.modules), quantization.method,
                    quantization.weights, f"; kept in {str(dtype).replace('torch.', '')}: {', '.join(plan.skipped)}"
                    if plan.skipped else "")
    model.eval()
    logger.info(
        "Loaded %s (%s, %.1fM params) from %s in %.2fs",
        model_class.__name__,
        str(dtype).replace("torch.", ""),
        sum(p.numel() for p in model.parameters()) / 1e6,
        model_config.model_path,
        time.perf_counter() - start,
    )
    return model
