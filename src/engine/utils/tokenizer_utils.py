"""Loading the Hugging Face tokenizer of a model directory."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """Load the (fast when available) tokenizer stored in `path`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    logger.debug("Loaded tokenizer %s from %s", type(tokenizer).__name__, path)
    return tokenizer
