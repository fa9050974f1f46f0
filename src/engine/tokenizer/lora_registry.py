"""The TokenizerManager's view of the LoRA adapters (SGLang's LoRARegistry): which names are served,
and how many requests in flight use each one.

A request naming an adapter that is not loaded gets a 400 here, before it is sent. Unloading first
takes the name out (new requests get the 400), then waits until the requests in flight that use it
have ended, then asks the schedulers; so an unload never fails a request that was accepted.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Dict, Iterable, List, Optional

from engine.errors import EngineRequestError
from engine.lora.lora_config import parse_lora_path_arg


class LoRARegistry:
    def __init__(self, lora_paths: Optional[List[str]]) -> None:
        specs = [parse_lora_path_arg(item) for item in lora_paths or []]  # checked by ServerArgs
        self._paths: Dict[str, str] = {s.name: s.path for s in specs}
        self._in_flight: Counter = Counter()
        self._changed = asyncio.Event()

    def adapters(self) -> Dict[str, str]:
        """name -> path of the adapters requests may use."""
        return dict(self._paths)

    def check(self, names: Iterable[str]) -> None:
        for name in names:
            if name not in self._paths:
                loaded = ", ".join(sorted(self._paths)) or "none"
                raise EngineRequestError(f"LoRA adapter {name[:256]!r} is not loaded (loaded: {loaded[:1000]}).")

    def acquire(self, names: List[str]) -> None:
        self._in_flight.update(names)

    def release(self, names: List[str]) -> None:
        self._in_flight.subtract(names)
        self._changed.set()

    def register(self, name: str, path: str) -> None:
        self._paths[name] = path

    def unregister(self, name: str) -> Optional[str]:
        """Stop accepting requests for `name`; its path, or None when it was not registered."""
        return self._paths.pop(name, None)

    async def wait_unused(self, name: str, timeout: float) -> bool:
        """Wait until no request in flight uses `name` (False after `timeout` seconds)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._in_flight[name] > 0:
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=left)
            except asyncio.TimeoutError:
                return False
        return True


def loaded_adapters(registry: Optional[LoRARegistry]) -> Optional[Dict[str, str]]:
    """name -> path of the loaded adapters, None without --enable-lora."""
    return registry.adapters() if registry is not None else None
