"""Issue 34, item 4: the request-body limit holds for every method, also for a chunked body.

A chunked GET /get_weights_by_name of 200 MB was parsed and echoed back: the limit was read only for
POST, PUT and PATCH. Here the app runs in-process over the fake TokenizerManager of test_http_app.
"""

from __future__ import annotations

from typing import Iterator

import pytest
from fastapi.testclient import TestClient

from engine.entrypoints.http_server import create_app
from engine.server_args import ServerArgs
from test_http_app import FakeTokenizerManager

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app = create_app(FakeTokenizerManager(), ServerArgs(device="cpu"), max_request_body_bytes=LIMIT)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def _chunks(total: int, size: int = 8192) -> Iterator[bytes]:
    """A body without Content-Length (httpx sends it chunked)."""
    for _ in range(total // size):
        yield b"x" * size


@pytest.mark.parametrize("method", ["GET", "DELETE", "OPTIONS", "POST"])
@pytest.mark.parametrize("path", ["/get_weights_by_name", "/v1/models", "/health"])
def test_a_chunked_body_over_the_limit_is_refused_whatever_the_method(client: TestClient, method: str,
                                                                      path: str) -> None:
    response = client.request(method, path, content=_chunks(3 * LIMIT))
    assert response.status_code == 413
    error = response.json()  # the OpenAI-style error body
    assert error["object"] == "error" and error["code"] == 413 and f"limit of {LIMIT} bytes" in error["message"]


def test_a_declared_length_over_the_limit_is_refused_for_a_get(client: TestClient) -> None:
    response = client.request("GET", "/v1/models", content=b"y" * (LIMIT + 1))
    assert response.status_code == 413


def test_bodies_within_the_limit_still_reach_the_routes(client: TestClient) -> None:
    assert client.request("GET", "/v1/models", content=_chunks(LIMIT // 2)).status_code == 200
    assert client.get("/health").status_code == 200
    response = client.post("/generate", content=b'{"text": "ab", "sampling_params": {"max_new_tokens": 2}}',
                           headers={"content-type": "application/json"})
    assert response.status_code == 200 and response.json()["text"] == "cd"
