"""The scheduler's view of a mixture-of-experts model: its expert layout and the tokens routed per
expert (for /get_server_info, /metrics and SGLang's expert distribution recording requests).

The counts live in the model (layers/moe/expert_distribution.py); this owner only holds the handle
and answers the control requests. A dense model has none: the requests are refused (400) and the
internal state carries no "moe" entry.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from engine.io_struct import EXPERT_DISTRIBUTION_ACTIONS, ExpertDistributionReq, ExpertDistributionReqOutput
from engine.layers.moe.expert_distribution import ExpertDistributionRecorder


class ExpertStats:
    def __init__(self, recorder: Optional[ExpertDistributionRecorder], layout: Dict[str, int]) -> None:
        self.recorder = recorder
        self.layout = dict(layout)  # num_experts, num_experts_per_tok, ep_size, ...

    def state(self) -> Dict[str, Any]:
        """The internal state's "moe" entry: the layout, whether a recording runs, and the tokens routed
        to each expert id since start-up, summed over the layers."""
        if self.recorder is None:
            return {}
        return {"moe": {**self.layout, "recording": self.recorder.recording,
                        "routed_tokens": self.recorder.totals()}}

    def handle(self, req: ExpertDistributionReq, settle: Callable[[], None]) -> ExpertDistributionReqOutput:
        """start_record / stop_record / dump_record, after the forwards in flight have finished (so
        that a dump counts every forward scheduled before it)."""
        if req.action not in EXPERT_DISTRIBUTION_ACTIONS:
            return ExpertDistributionReqOutput(False, f"unknown expert distribution action {req.action!r}")
        if self.recorder is None:
            return ExpertDistributionReqOutput(False, "The model has no mixture-of-experts layers.")
        settle()
        if req.action == "start_record":
            self.recorder.start()
            return ExpertDistributionReqOutput(True, "Start recording the expert distribution.")
        if req.action == "stop_record":
            self.recorder.stop()
            return ExpertDistributionReqOutput(True, "Stop recording the expert distribution.")
        return ExpertDistributionReqOutput(True, "Dump expert distribution record.", logical_count=self.recorder.dump())
