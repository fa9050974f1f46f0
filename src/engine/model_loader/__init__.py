"""Loading weights from safetensors into tensor-parallel models."""

from engine.model_loader.loader import get_model
from engine.model_loader.weight_utils import default_weight_loader, load_weights_into, safetensors_weights_iterator

__all__ = ["get_model", "default_weight_loader", "load_weights_into", "safetensors_weights_iterator"]
