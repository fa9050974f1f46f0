"""Custom logit processors: per-request Python callables that edit the logits before sampling.

The wire format is SGLang's: `CustomLogitProcessor.to_str()` gives `{"callable": "<hex>"}`, the
hex being the dill serialization of the processor class; the scheduler deserializes it and calls
an instance as `processor(logits, custom_param_list)` on the logits rows of the requests that use
it (in place or returning the new rows), with each request's `sampling_params.custom_params` plus
`"__req__"` (the scheduler's Req) in `custom_param_list`.

Deserializing runs arbitrary code of the sender: it happens only in the scheduler and only with
--enable-custom-logit-processor (the TokenizerManager refuses the field otherwise and never
deserializes it). `dill` is an optional dependency (`pip install dill`).
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from functools import lru_cache
from typing import Any, Dict, List, Optional

import torch

from engine.scheduler.req import FINISH_ABORT

logger = logging.getLogger(__name__)

# Processors deserialized and kept (the same string arrives with every request of a client).
PROCESSOR_CACHE_SIZE = 64


class CustomLogitProcessorError(ValueError):
    """The serialized processor cannot be used (bad JSON, not dill, not a processor, no dill)."""


class CustomLogitProcessor(ABC):
    """Subclass it, implement __call__, send `MyProcessor.to_str()` as `custom_logit_processor`."""

    @abstractmethod
    def __call__(self, logits: torch.Tensor,
                 custom_param_list: Optional[List[Dict[str, Any]]] = None) -> torch.Tensor:
        """Edit `logits` ([rows, vocab], one row per request using this processor)."""

    @classmethod
    def to_str(cls) -> str:
        import dill

        return json.dumps({"callable": dill.dumps(cls).hex()})

    @classmethod
    def from_str(cls, json_str: str) -> "CustomLogitProcessor":
        return load_custom_logit_processor(json_str)


@lru_cache(maxsize=PROCESSOR_CACHE_SIZE)
def load_custom_logit_processor(json_str: str) -> Any:
    """An instance of the processor serialized in `json_str` (CustomLogitProcessorError if unusable)."""
    try:
        import dill
    except ImportError:
        raise CustomLogitProcessorError("custom_logit_processor needs the dill package on the server "
                                        "(pip install dill)") from None
    try:
        data = json.loads(json_str)
        blob = bytes.fromhex(data["callable"])
    except (ValueError, TypeError, KeyError):
        raise CustomLogitProcessorError(
            "custom_logit_processor must be the JSON of CustomLogitProcessor.to_str(): "
            '{"callable": "<hex of the dill-serialized processor>"}') from None
    try:
        obj = dill.loads(blob)
    except Exception as e:  # noqa: BLE001 - whatever unpickling raises, the request is refused
        raise CustomLogitProcessorError(f"custom_logit_processor could not be deserialized: {e!r}") from None
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001
            raise CustomLogitProcessorError(f"custom_logit_processor could not be instantiated: {e!r}") from None
    if not callable(obj):
        raise CustomLogitProcessorError("custom_logit_processor is not callable")
    return obj


def apply_custom_logit_processors(logits: torch.Tensor, processors: Dict[str, List[int]],
                                  params: List[Optional[Dict[str, Any]]]) -> None:
    """Run every processor on its rows of `logits` ([bs, vocab]), in place.

    `processors` maps a serialized processor to the batch rows that use it; `params` holds each
    row's custom_params (with "__req__").
    """
    for json_str, rows in processors.items():
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        row_params = [params[r] for r in rows]
        try:
            out = load_custom_logit_processor(json_str)(logits[index], row_params)
            if not isinstance(out, torch.Tensor) or out.shape != (len(rows), logits.shape[1]):
                raise CustomLogitProcessorError(f"it returned {type(out).__name__} "
                                                f"{tuple(getattr(out, 'shape', ()))}, not the [{len(rows)}, "
                                                f"{logits.shape[1]}] logits")
        except Exception as e:  # noqa: BLE001 - a client's code must not take the server down
            # Its requests end with a 400 at this step's result; the logits stay as they were.
            logger.warning("custom_logit_processor failed: %r", e)
            for p in row_params:
                req = (p or {}).get("__req__")
                if req is not None:
                    req.to_finish = FINISH_ABORT(f"custom_logit_processor failed: {e!r}", 400, "BadRequestError")
            continue
        logits[index] = out.to(logits.dtype)
