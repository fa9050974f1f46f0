"""Logging setup shared by the main process and the children."""

from __future__ import annotations

import logging

_FORMAT = "[%(asctime)s%(prefix)s] %(levelname)s %(name)s: %(message)s"


class _PrefixFilter(logging.Filter):
    """Adds the process role (" TP0", " DETOKENIZER") to every record, as SGLang's logs do."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        record.prefix = self.prefix
        return True


def configure_logging(log_level: str = "info", prefix: str = "") -> None:
    """Configure the root logger once per process; `prefix` names the process in each line."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    handler.addFilter(_PrefixFilter(f" {prefix}" if prefix else ""))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(log_level.upper())
