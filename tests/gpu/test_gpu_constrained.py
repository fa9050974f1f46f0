"""Constrained decoding on CUDA: the vocabulary mask on the device, delayed sampling on the forward
stream (overlap loop) and CUDA graphs; the built-in random model, so only the grammar makes the
outputs valid. The same greedy outputs with overlap on and off."""

from __future__ import annotations

import json
import re
from typing import Dict, List, Tuple

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("xgrammar", reason="constrained decoding needs xgrammar")
jsonschema = pytest.importorskip("jsonschema", reason="schema validation needs jsonschema")

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["id", "tags", "ok"], "additionalProperties": False}
REGEX = r"[a-z]{3,8}( [a-z]{2,6}){0,3}\."
CONSTRAINTS = [{"json_schema": json.dumps(SCHEMA)}, {"regex": REGEX}, {}]


def _run(overlap: bool) -> Tuple[List[List[int]], List[Dict]]:
    from transformers import AutoTokenizer

    from engine.builtin_model import ensure_builtin_model
    from engine.io_struct import BatchTokenIDOutput, TokenizedGenerateReqInput
    from engine.scheduler.scheduler import Scheduler
    from engine.server_args import ServerArgs

    path = ensure_builtin_model()
    tok = AutoTokenizer.from_pretrained(path)
    args = ServerArgs(model_path=path, device="cuda", dtype="float32", max_total_tokens=1 << 15,
                      disable_overlap_schedule=not overlap, strict_memory_check=True, log_level="warning",
                      constrained_json_disable_any_whitespace=True, cuda_graph_max_bs=8)
    scheduler = Scheduler(args, tokenizer=tok)
    outputs: Dict[str, List[int]] = {}
    reasons: Dict[str, Dict] = {}
    for i in range(12):
        rid = str(i)
        outputs[rid] = []
        sampling = {"max_new_tokens": 80, "temperature": 0.0, **CONSTRAINTS[i % len(CONSTRAINTS)]}
        scheduler.add_request(TokenizedGenerateReqInput(
            rid=rid, input_ids=tok(f"Request {i}: answer.").input_ids, sampling_params=sampling))
    steps = 0
    while scheduler.has_work():
        scheduler.step_overlap() if overlap else scheduler.step()
        for msg in scheduler.outbox:
            if isinstance(msg, BatchTokenIDOutput):
                for j, rid in enumerate(msg.rids):
                    outputs[rid].extend(msg.output_ids[j])
                    if msg.finished_reasons[j] is not None:
                        reasons[rid] = msg.finished_reasons[j]
        scheduler.outbox.clear()
        steps += 1
        assert steps < 10_000
    scheduler.step_overlap() if overlap else scheduler.step()  # the idle memory check
    scheduler.shutdown()
    texts = [tok.decode(outputs[str(i)], skip_special_tokens=True) for i in range(12)]
    for i, text in enumerate(texts):
        kind = i % len(CONSTRAINTS)
        if kind == 0:
            assert reasons[str(i)]["type"] == "stop", (text, reasons[str(i)])
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == 1:
            assert reasons[str(i)]["type"] == "stop" and re.fullmatch(REGEX, text), text
    return [outputs[str(i)] for i in range(12)], [reasons[str(i)] for i in range(12)]


def test_constrained_outputs_valid_and_equal_with_and_without_overlap():
    assert _run(overlap=True) == _run(overlap=False)
