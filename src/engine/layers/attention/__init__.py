"""Attention backends and the factory that picks one by `--attention-backend`."""

from __future__ import annotations

from engine.layers.attention.base_attn_backend import AttentionBackend, AttentionRunner


def create_attention_backend(name: str, model_runner: AttentionRunner) -> AttentionBackend:
    if name == "torch_native":
        from engine.layers.attention.torch_native_backend import TorchNativeAttnBackend

        return TorchNativeAttnBackend(model_runner)
    if name == "triton":
        try:
            from engine.layers.attention.triton_backend import TritonAttnBackend
        except ImportError as e:
            raise ValueError(f"attention backend 'triton' is not available yet ({e}); use --attention-backend torch_native") from e
        return TritonAttnBackend(model_runner)
    if name == "flashinfer":
        try:
            from engine.layers.attention.flashinfer_backend import FlashInferAttnBackend
        except ImportError as e:
            raise ValueError(f"attention backend 'flashinfer' is not available ({e}); use --attention-backend torch_native") from e
        return FlashInferAttnBackend(model_runner)
    raise ValueError(f"unknown attention backend {name!r}; choose torch_native, triton or flashinfer")


__all__ = ["AttentionBackend", "create_attention_backend"]
