"""The server of test_http_slow_clients.py, in a process of its own: the real HTTP stack
(build_http_server: uvicorn, the guarded protocol, the app) over test_http_app's fake
TokenizerManager, whose streamed tokens come `--step` seconds apart, under a low open-file limit
(`--nofile`) so that a few hundred connections can use up its descriptors.

    python slow_clients_server.py --port P [--nofile N] [--step S] [--http-... flags of ServerArgs]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
from typing import Any, AsyncIterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_http_app import FakeTokenizerManager  # noqa: E402

from engine.entrypoints.http_server import build_http_server  # noqa: E402
from engine.server_args import ServerArgs  # noqa: E402


class SlowStreams(FakeTokenizerManager):
    """Streams take `step` seconds per token: longer than every deadline of the connection."""

    def __init__(self, step: float) -> None:
        super().__init__()
        self.step = step

    async def generate_request(self, obj: Any, request: Any = None, incremental: bool = False) -> AsyncIterator[Any]:
        async for out in super().generate_request(obj, request, incremental):
            if obj.stream:
                await asyncio.sleep(self.step)  # the model's time per token
            yield out

    def begin_shutdown(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nofile", type=int, default=0)
    parser.add_argument("--step", type=float, default=0.0)
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args()
    if args.nofile:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, hard))
    names = {f for f in vars(args) if f not in ("nofile", "step")}
    server_args = ServerArgs(**{k: v for k, v in vars(args).items() if k in names})
    build_http_server(server_args, SlowStreams(args.step)).run()


if __name__ == "__main__":
    main()
