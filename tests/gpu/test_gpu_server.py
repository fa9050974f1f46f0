"""End to end on CUDA: `python -m engine.launch_server --device cuda` with the built-in model and
the CUDA defaults (triton attention, CUDA graphs, overlap scheduling, KV pool sized from
--mem-fraction-static), checked over HTTP against transformers' greedy output on the same GPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator, List

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STARTUP_TIMEOUT_S = 300
STEPS = 12


class Server:
    def __init__(self, extra_args: List[str]) -> None:
        from engine.utils.network_utils import get_free_port

        self.port = get_free_port()
        fd, self.log_path = tempfile.mkstemp(prefix="engine-gpu-server-", suffix=".log")
        cmd = [sys.executable, "-m", "engine.launch_server", "--port", str(self.port), "--device", "cuda",
               "--log-level", "info", "--strict-memory-check", *extra_args]
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-6000:]

    def wait_healthy(self) -> None:
        import httpx

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server(["--dtype", "float32"])
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@torch.no_grad()
def _hf_greedy(model, ids: List[int], steps: int) -> List[int]:
    t = torch.tensor([ids], device="cuda")
    out = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=steps,
                         min_new_tokens=steps, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_server_on_cuda_matches_transformers(server: Server) -> None:
    import httpx
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.builtin_model import ensure_builtin_model

    path = ensure_builtin_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    texts = ["Hello, my name is", "The capital of France", "1 2 3 4 5", "Once upon a time, in a land"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    expected = [_hf_greedy(model, p, STEPS) for p in prompts]
    params = {"max_new_tokens": STEPS, "ignore_eos": True, "temperature": 0.0}

    with httpx.Client(base_url=server.url, timeout=120.0) as http:
        info = http.get("/get_model_info").json()
        # Sized from GPU memory: far beyond what the CPU default or a test pool would hold.
        assert info["max_total_num_tokens"] > 100_000, info

        # One at a time: decode batches of 1 (a captured size).
        for prompt, want in zip(prompts, expected):
            out = http.post("/generate", json={"input_ids": prompt, "sampling_params": params}).json()
            assert out["output_ids"] == want
            assert out["meta_info"]["completion_tokens"] == STEPS

        # All at once: decode batches of 4, then the same answers.
        batch = http.post("/generate", json={"input_ids": prompts, "sampling_params": params}).json()
        assert [b["output_ids"] for b in batch] == expected

        # Streaming through the same path: the deltas add up to the final text.
        with http.stream("POST", "/generate", json={"text": texts[0], "sampling_params": params,
                                                     "stream": True}) as resp:
            assert resp.status_code == 200
            events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
    assert "Captured" in server.log() and "CUDA graphs" in server.log(), server.log()
