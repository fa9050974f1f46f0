"""Starting a server's processes: the schedulers (or the DP controller in front of them), the
detokenizer, and a PD prefill server's bootstrap server; then this process's TokenizerManager.

`launch_subprocesses` is shared by `launch_server` and the offline `Engine`. Every child reports
ready (or its error) over a pipe (launch/children.py); on any failure every started child is
killed and LaunchError is raised.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Optional

from engine.launch.children import ChildProcesses, LaunchError
from engine.launch.tp_group import launch_tp_group
from engine.port_args import PortArgs
from engine.server_args import ServerArgs
from engine.tokenizer.request_normalizer import load_chat_template
from engine.tokenizer.tokenizer_manager import TokenizerManager
from engine.utils.network_utils import get_free_port
from engine.utils.tokenizer_utils import load_tokenizer, tokenizer_to_bytes

if TYPE_CHECKING:
    from engine.disaggregation.bootstrap import BootstrapServer

logger = logging.getLogger(__name__)


def resolve_model_path(server_args: ServerArgs) -> ServerArgs:
    """Without --model-path, serve the built-in model; children get the resolved path."""
    if server_args.model_path is not None:
        if server_args.tokenizer_path is None:
            return dataclasses.replace(server_args, tokenizer_path=server_args.model_path)
        return server_args
    from engine.builtin_model import ensure_builtin_model

    path = ensure_builtin_model()
    return dataclasses.replace(server_args, model_path=path, tokenizer_path=server_args.tokenizer_path or path)


@dataclasses.dataclass
class LaunchedChildren:
    """The started, ready children of a server and what its TokenizerManager(s) need of them."""

    server_args: ServerArgs  # with the model path resolved
    port_args: PortArgs
    children: ChildProcesses
    scheduler_info: dict  # scheduler rank 0's ready message
    tokenizer: Any  # loaded while the children started (None when not asked for)
    bootstrap_server: Optional["BootstrapServer"]  # a PD prefill server's, else None

    def close(self) -> None:
        self.children.shutdown()
        if self.bootstrap_server is not None:
            self.bootstrap_server.close()


def launch_children(server_args: ServerArgs, load_tokenizer_too: bool = True) -> LaunchedChildren:
    """Start the schedulers and the detokenizer and wait for them.

    On any failure every started child is killed and LaunchError is raised.
    """
    from engine.detokenizer.detokenizer_manager import run_detokenizer_process

    try:
        load_chat_template(server_args.chat_template)  # fail before anything is started
    except (OSError, ValueError) as e:
        raise LaunchError(f"Bad --chat-template: {e}") from None
    server_args = resolve_model_path(server_args)
    port_args = PortArgs.init_new(server_args)
    if port_args.nccl_port == 0:
        port_args.nccl_port = get_free_port()
    children = ChildProcesses(port_args.ipc_dir)
    # A PD prefill server's bootstrap server runs here, before its ranks start and register.
    bootstrap_server = start_bootstrap_server(server_args)
    try:
        # Schedulers of this node (dp_size 1) or the data-parallel controller that starts them.
        info_child = start_scheduler_processes(children, server_args, port_args)
        # Load the tokenizer while the schedulers import torch and load the model, not after; the
        # detokenizer starts once it is loaded and gets a copy (it does not load it again).
        tokenizer = load_server_tokenizer(server_args) if load_tokenizer_too else None
        if server_args.node_rank == 0:
            tokenizer_bytes = tokenizer_to_bytes(tokenizer) if tokenizer is not None else None
            children.start("detokenizer", run_detokenizer_process, (server_args, port_args, tokenizer_bytes))
        infos = children.wait_ready(server_args.startup_timeout)
        scheduler_info = infos[info_child]
        logger.info("All child processes are ready: max_total_num_tokens=%s, context_len=%s, "
                    "max_req_input_len=%s", scheduler_info.get("max_total_num_tokens"),
                    scheduler_info.get("context_len"), scheduler_info.get("max_req_input_len"))
    except BaseException:
        children.shutdown()
        if bootstrap_server is not None:
            bootstrap_server.close()
        raise
    return LaunchedChildren(server_args, port_args, children, scheduler_info, tokenizer, bootstrap_server)


def load_server_tokenizer(server_args: ServerArgs) -> Any:
    """The tokenizer of a server whose model path is resolved (None with --skip-tokenizer-init)."""
    tokenizer_path = server_args.tokenizer_path or server_args.model_path
    assert tokenizer_path is not None  # resolve_model_path filled it in
    return None if server_args.skip_tokenizer_init else load_tokenizer(tokenizer_path, server_args.trust_remote_code)


def launch_subprocesses(server_args: ServerArgs) -> tuple[ServerArgs, ChildProcesses, TokenizerManager]:
    """launch_children, then the TokenizerManager of this process (which closes the bootstrap server)."""
    launched = launch_children(server_args)
    try:
        tokenizer_manager = TokenizerManager(launched.server_args, launched.port_args, launched.scheduler_info,
                                             child_processes=launched.children.processes(),
                                             tokenizer=launched.tokenizer)
    except BaseException:
        launched.close()
        raise
    tokenizer_manager.bootstrap_server = launched.bootstrap_server
    return launched.server_args, launched.children, tokenizer_manager


def start_bootstrap_server(server_args: ServerArgs) -> Optional["BootstrapServer"]:
    """The bootstrap server of a PD prefill server (tcp backend, node 0), else None."""
    if (server_args.disaggregation_mode != "prefill" or server_args.disaggregation_transfer_backend != "tcp"
            or server_args.node_rank != 0):
        return None
    from engine.disaggregation.auth import resolve_secret
    from engine.disaggregation.bootstrap import BootstrapServer, LocalGenerateForwarder

    # A decode server's re-bootstrap after pause_generation(retract) becomes a request to this
    # server's own /generate (with its API key): the HTTP layer, gate and scheduler as for any.
    host = server_args.host if server_args.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    forwarder = LocalGenerateForwarder(f"http://{host}:{server_args.port}", server_args.api_key,
                                       timeout=server_args.disaggregation_bootstrap_timeout
                                       + server_args.disaggregation_waiting_timeout)
    try:
        return BootstrapServer(server_args.host, server_args.disaggregation_bootstrap_port, server_args.tp_size,
                               secret=resolve_secret(server_args.disaggregation_secret), submit=forwarder)
    except OSError as e:
        raise LaunchError(f"cannot start the bootstrap server on port {server_args.disaggregation_bootstrap_port}: "
                          f"{e}") from None


def start_scheduler_processes(children: ChildProcesses, server_args: ServerArgs, port_args: PortArgs) -> str:
    """Start this node's schedulers (dp_size 1) or the DP controller that starts them.

    Returns the child name whose ready message carries the scheduler limits.
    """
    if server_args.tp_size % server_args.nnodes != 0:
        raise LaunchError(f"--tp-size ({server_args.tp_size}) must be a multiple of --nnodes ({server_args.nnodes}).")
    if server_args.dp_size == 1:
        return launch_tp_group(children, server_args, port_args)
    if server_args.nnodes > 1:
        raise LaunchError("--dp-size > 1 with --nnodes > 1 is not supported; run one server per node instead.")
    from engine.dp_controller.controller import CONTROLLER_CHILD_NAME, run_data_parallel_controller_process

    children.start(CONTROLLER_CHILD_NAME, run_data_parallel_controller_process, (server_args, port_args))
    return CONTROLLER_CHILD_NAME
