"""engine: a multi-process LLM serving engine with the architecture of SGLang's runtime."""

from __future__ import annotations

from typing import Any

from engine.server_args import ServerArgs

__all__ = ["Engine", "ServerArgs"]


def __getattr__(name: str) -> Any:
    # Engine pulls in the runtime (zmq, transformers); import it only when asked for.
    if name == "Engine":
        from engine.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
