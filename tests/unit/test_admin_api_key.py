"""--admin-api-key: the operator routes (weights, memory, pause/continue, flush, abort) take the
admin key, the API keeps --api-key, with SGLang's rules for one key or both (http_auth.py). And a
failed /update_weights_from_disk tells a client nothing about the server's files.

The app runs in-process over test_http_app's fake TokenizerManager, with a control plane that
records what reached it: a refused call must never get there.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from test_http_app import FakeTokenizerManager

from engine.entrypoints.http_server import create_app
from engine.io_struct import UpdateWeightFromDiskReqInput
from engine.model_executor.weight_update import WeightUpdater
from engine.server_args import ServerArgs

USER, ADMIN = "user-key", "admin-key"


class RecordingControl:
    """ControlCalls' answers; `calls` lists every call that reached the control plane. Weight
    updates fail as the real WeightUpdater fails on a path it cannot load (the reason names the
    path and what is there)."""

    def __init__(self) -> None:
        self.calls: List[str] = []
        self.weight_version = "default"

    async def update_weights_from_disk(self, obj: UpdateWeightFromDiskReqInput) -> Tuple[bool, str, int]:
        self.calls.append("update_weights_from_disk")
        ok, message = WeightUpdater(torch.nn.Linear(1, 1), None, "cpu").update_from_disk(obj.model_path)  # type: ignore[arg-type]
        return ok, message, 0

    async def get_weights_by_name(self, name: str, truncate_size: int) -> List[float]:
        self.calls.append("get_weights_by_name")
        return [0.0]

    async def release_memory_occupation(self, tags: Optional[List[str]]) -> Dict[str, Any]:
        self.calls.append("release_memory_occupation")
        return {"success": True, "message": ""}

    async def resume_memory_occupation(self, tags: Optional[List[str]]) -> Dict[str, Any]:
        self.calls.append("resume_memory_occupation")
        return {"success": True, "message": ""}

    async def pause_generation(self, mode: str) -> Dict[str, Any]:
        self.calls.append("pause_generation")
        return {"success": True, "message": ""}

    async def continue_generation(self, torch_empty_cache: bool) -> Dict[str, Any]:
        self.calls.append("continue_generation")
        return {"success": True, "message": ""}


class ControlledManager(FakeTokenizerManager):
    def __init__(self) -> None:
        super().__init__()
        self.control = RecordingControl()

    async def flush_cache(self) -> Any:
        self.control.calls.append("flush_cache")
        return await super().flush_cache()


# (method, path, body) of operator calls that succeed when let in.
OPERATOR_CALLS = [
    ("POST", "/flush_cache", None),
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/pause_generation", {"mode": "abort"}),
    ("POST", "/continue_generation", None),
    ("POST", "/release_memory_occupation", {"tags": None}),
    ("POST", "/resume_memory_occupation", {"tags": None}),
    ("POST", "/get_weights_by_name", {"name": "model.embed_tokens.weight"}),
]
API_CALLS = [
    ("GET", "/v1/models", None),
    ("GET", "/get_server_info", None),
    ("POST", "/generate", {"text": "ab", "sampling_params": {"max_new_tokens": 2}}),
    ("POST", "/v1/completions", {"prompt": "ab", "max_tokens": 2}),
]


def _client(api_key: Optional[str], admin_api_key: Optional[str]) -> Tuple[TestClient, ControlledManager]:
    manager = ControlledManager()
    app = create_app(manager, ServerArgs(device="cpu", api_key=api_key, admin_api_key=admin_api_key))
    return TestClient(app, raise_server_exceptions=False), manager


def _call(client: TestClient, method: str, path: str, body: Any, key: Optional[str]) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return client.request(method, path, json=body, headers=headers)


def _reached(manager: ControlledManager) -> int:
    return len(manager.control.calls) + len(manager.aborts)


@pytest.mark.parametrize("method, path, body", OPERATOR_CALLS)
def test_with_both_keys_operator_routes_take_the_admin_key_only(method, path, body) -> None:
    client, manager = _client(USER, ADMIN)
    for key in (None, USER, "wrong"):
        response = _call(client, method, path, body, key)
        assert response.status_code == 401, (key, response.text)
        assert "admin API key" in response.json()["message"]
    assert _reached(manager) == 0, "a refused call reached the control plane"
    assert _call(client, method, path, body, ADMIN).status_code == 200
    assert _reached(manager) == 1


@pytest.mark.parametrize("method, path, body", API_CALLS)
def test_with_both_keys_the_api_takes_the_api_key_only(method, path, body) -> None:
    client, _ = _client(USER, ADMIN)
    assert _call(client, method, path, body, USER).status_code == 200
    for key in (None, ADMIN):  # SGLang: the admin key is not an API key
        assert _call(client, method, path, body, key).status_code == 401


def test_with_the_admin_key_only_the_api_is_open_and_operator_routes_are_not() -> None:
    client, manager = _client(None, ADMIN)
    for method, path, body in API_CALLS:
        assert _call(client, method, path, body, None).status_code == 200, path
    for method, path, body in OPERATOR_CALLS:
        assert _call(client, method, path, body, None).status_code == 401, path
        assert _call(client, method, path, body, USER).status_code == 401, path
    assert _reached(manager) == 0
    assert client.get("/health").status_code == 200


def test_with_the_api_key_only_it_opens_every_route_as_in_sglang() -> None:
    client, manager = _client(USER, None)
    for method, path, body in OPERATOR_CALLS + API_CALLS:
        assert _call(client, method, path, body, None).status_code == 401, path
        assert _call(client, method, path, body, USER).status_code == 200, path
    assert _reached(manager) == len(OPERATOR_CALLS)


def test_every_control_route_is_an_operator_route() -> None:
    """Whatever control_routes.py registers (weights from tensors or a trainer's group, versions...)
    refuses the API key once an admin key is set, before its body is even parsed."""
    client, manager = _client(USER, ADMIN)
    control = [(sorted(route.methods)[0], route.path) for route in client.app.routes  # type: ignore[attr-defined]
               if isinstance(route, APIRoute) and route.endpoint.__module__ == "engine.entrypoints.control_routes"]
    assert len(control) >= 6, control
    for method, path in control:
        assert _call(client, method, path, {}, USER).status_code == 401, path
    assert _reached(manager) == 0


def test_server_info_hides_both_keys() -> None:
    client, _ = _client(USER, ADMIN)
    info = _call(client, "GET", "/get_server_info", None, USER).json()
    assert "api_key" not in info and "admin_api_key" not in info
    assert ADMIN not in str(info) and USER not in str(info)


def test_a_failed_weight_update_does_not_tell_what_a_path_holds(tmp_path) -> None:
    """No such path, a directory without a checkpoint, a file: the server's reasons differ (and name
    the path), the answers must not."""
    client, manager = _client(None, ADMIN)
    (tmp_path / "secret.txt").write_text("x")
    answers = []
    for path in ("/nonexistent/checkpoint", str(tmp_path), str(tmp_path / "secret.txt")):
        response = _call(client, "POST", "/update_weights_from_disk", {"model_path": path}, ADMIN)
        assert response.status_code == 400 and response.json()["success"] is False
        assert path not in response.text and "No such file" not in response.text
        answers.append(response.json())
    assert answers[0] == answers[1] == answers[2]
    assert manager.control.calls == ["update_weights_from_disk"] * 3


def test_an_unsupported_load_format_is_refused_before_any_file_is_read() -> None:
    client, manager = _client(None, None)
    response = _call(client, "POST", "/update_weights_from_disk", {"model_path": "/x", "load_format": "gguf"}, None)
    assert response.status_code == 400 and "load_format" in response.json()["message"]
    assert manager.control.calls == []
