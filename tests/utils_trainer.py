"""A stand-in RL trainer that pushes weights to a server over a torch.distributed group.

Run as a script in its own process (as a verl / slime trainer would be):

    python tests/utils_trainer.py --port P --world-size N --weights a.safetensors [b.safetensors ...] \
        [--server http://127.0.0.1:PORT]

It is rank 0 of the group: it hosts the TCPStore on a socket bound to 127.0.0.1 (nothing listens
beyond loopback; gloo's pairs use `lo` through GLOO_SOCKET_IFNAME) and broadcasts the tensors of
each `--weights` file in turn (one update per file, a "bucket"), in sorted-name order.

With `--server` it also drives the server the way SGLang's trainers do: /init_weights_update_group
in a thread while it joins, /update_weights_from_distributed in a thread while it broadcasts each
bucket, then /destroy_weights_update_group. It prints one JSON line: {"replies": [[status, body],
...]}. Without `--server` the test drives the server side itself and only the group work happens
here. `trainer_metadata` gives the (names, dtypes, shapes) of a bucket for that case.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch

GROUP = "test_weight_sync"
TIMEOUT = timedelta(seconds=120)


def trainer_metadata(weights: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """The body fields SGLang's trainers send for one bucket, in broadcast order."""
    names = sorted(weights)
    return {"names": names, "dtypes": [str(weights[n].dtype).replace("torch.", "") for n in names],
            "shapes": [list(weights[n].shape) for n in names]}


def trainer_env() -> Dict[str, str]:
    """The environment of a trainer (and server) process whose gloo pairs stay on loopback."""
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}


def _post(url: str, body: Dict[str, Any], out: List[Tuple[int, Any]]) -> None:
    import httpx

    response = httpx.post(url, json=body, timeout=TIMEOUT.total_seconds())
    out.append((response.status_code, response.json()))


def _in_thread(url: Optional[str], body: Dict[str, Any], out: List[Tuple[int, Any]]) -> Optional[threading.Thread]:
    if url is None:
        return None
    thread = threading.Thread(target=_post, args=(url, body, out), daemon=True)
    thread.start()
    return thread


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--weights", nargs="+", required=True)
    parser.add_argument("--server", default=None)
    parser.add_argument("--weight-version", default=None)
    args = parser.parse_args()

    import torch.distributed as dist
    from safetensors.torch import load_file

    from engine.distributed.weight_update_group import init_custom_process_group

    buckets = [load_file(path) for path in args.weights]
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", args.port))
    listener.listen()
    store = dist.TCPStore("127.0.0.1", args.port, args.world_size, True, timeout=TIMEOUT, wait_for_workers=False,
                          master_listen_fd=listener.fileno())
    replies: List[Tuple[int, Any]] = []
    server = args.server
    join = _in_thread(f"{server}/init_weights_update_group" if server else None, {
        "master_address": "127.0.0.1", "master_port": args.port, "rank_offset": 1,
        "world_size": args.world_size, "group_name": GROUP, "backend": "gloo"}, replies)
    group = init_custom_process_group("gloo", timeout=TIMEOUT, world_size=args.world_size, rank=0, store=store,
                                      group_name=GROUP)
    if join is not None:
        join.join()
    for weights in buckets:
        body = {**trainer_metadata(weights), "group_name": GROUP}
        if args.weight_version is not None:
            body["weight_version"] = args.weight_version
        update = _in_thread(f"{server}/update_weights_from_distributed" if server else None, body, replies)
        works = [dist.broadcast(weights[name], src=0, group=group, async_op=True) for name in sorted(weights)]
        for work in works:
            work.wait()
        if update is not None:
            update.join()
    if server is not None:
        _post(f"{server}/destroy_weights_update_group", {"group_name": GROUP}, replies)
    dist.destroy_process_group(group)
    print(json.dumps({"replies": replies}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
