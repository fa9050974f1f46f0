"""The speculation switch (engine/speculative/switch.py): decode plainly where drafts do not pay.

- its rule on synthetic costs: off when accept length x plain cost < verify cost, probes that back
  off (a bounded share of verify steps), on again when a probe finds drafts pay, the refresh of the
  plain cost while on, the TP agreement, and --disable-speculative-adaptive;
- with a scheduler: outputs stay exact while the switch flips (every algorithm), a draft model
  (STANDALONE, EAGLE) runs no forward on the plain steps and still has every draft accepted when it
  is the target (its lazy catch-up is exact), and a poor draft really is switched off.
"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from sched_utils import Harness
from test_speculative_eagle import exact_pair  # noqa: F401  (a module fixture)
from test_speculative_ngram import VOCAB, _prompts
from utils_models import LetterTokenizer, build_tiny_model

from engine.server_args import ServerArgs
from engine.speculative import switch as sw
from engine.speculative.step import VerifyStep


def _drive(s: sw.SpeculationSwitch, steps: int, plain_s: float, verify_s: float, tokens: float,
           batch_size: int = 1) -> List[bool]:
    """Run `steps` decode steps of fixed costs through the switch; which ones verified."""
    chosen = []
    for _ in range(steps):
        verify = s.should_verify(batch_size)
        s.record(batch_size, verify, verify_s if verify else plain_s, tokens)
        chosen.append(verify)
    return chosen


def test_low_acceptance_switches_off_and_probes_back_off():
    s = sw.SpeculationSwitch(True)
    chosen = _drive(s, 3000, plain_s=1.0, verify_s=3.0, tokens=1.2)
    assert chosen[:2] == [True, True] and chosen[2:4] == [False, False]  # the warm-up of each kind
    assert not any(chosen[4:sw.MIN_PROBE_INTERVAL + 3])
    probes = [i for i, v in enumerate(chosen) if v][2:]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    # A probe costs 3.0 - 1.2 plain steps: the first comes 1.8 / PROBE_BUDGET = 90 steps after the switch
    # turned off, and each probe that finds drafts still do not pay doubles the interval up to its maximum.
    budget = round(1.8 / sw.PROBE_BUDGET)
    assert probes[0] - 3 == budget
    assert gaps[:1] == [2 * budget]
    assert set(gaps[1:]) == {sw.MAX_PROBE_INTERVAL}
    # The cost of exploring: time of these steps, less what the probes emitted, within the budget.
    cost = sum(3.0 - 1.2 + 1.0 if v else 1.0 for v in chosen[4:])
    assert len(chosen[4:]) / cost > 1 - sw.PROBE_BUDGET
    assert s.state()["spec_on_by_batch_size"] == {1: False}


@pytest.mark.parametrize("tokens", [1.2, 3.5])  # switched off (probes), stays on (refreshes)
def test_would_verify_foretells_should_verify_and_changes_nothing(tokens):
    """The overlap loop asks would_verify before it builds a batch: it must answer what the next
    should_verify will, however often it is asked."""
    s = sw.SpeculationSwitch(True)
    for _ in range(600):
        told = [s.would_verify(1) for _ in range(3)]
        verify = s.should_verify(1)
        assert told == [verify] * 3
        s.record(1, verify, 3.0 if verify else 1.0, tokens)


def test_high_acceptance_stays_on_refreshing_the_plain_cost():
    s = sw.SpeculationSwitch(True)
    chosen = _drive(s, 1000, plain_s=1.0, verify_s=2.0, tokens=3.5)
    plain = [i for i, v in enumerate(chosen) if not v]
    assert plain[:2] == [2, 3]  # the warm-up
    assert [b - a for a, b in zip(plain[2:], plain[3:])] == [sw.PLAIN_REFRESH_INTERVAL] * (len(plain) - 3)
    assert s.switches == 0


def test_a_probe_that_pays_switches_back_on():
    s = sw.SpeculationSwitch(True)
    _drive(s, 200, plain_s=1.0, verify_s=3.0, tokens=1.0)
    assert s.state()["spec_on_by_batch_size"] == {1: False}
    # The workload changes: drafts are now accepted (4 tokens a step); the probes see it (a probe's
    # acceptance weighs half, and turning on needs a 10% margin: three of them here).
    chosen = _drive(s, 4 * sw.MAX_PROBE_INTERVAL, plain_s=1.0, verify_s=3.0, tokens=4.0)
    assert sum(chosen[-sw.PLAIN_REFRESH_INTERVAL:]) >= sw.PLAIN_REFRESH_INTERVAL - 1
    assert s.state()["spec_on_by_batch_size"] == {1: True}
    assert s.switches == 2


def test_a_busy_spell_of_the_machine_does_not_switch_it_on():
    """Plain steps that took 4x as long for a while (neighbours on a shared machine) while the probes
    happened to run in quiet moments: the plain cost is the fastest of a long window, so the probes
    do not look profitable."""
    s = sw.SpeculationSwitch(True)
    _drive(s, 100, plain_s=1.0, verify_s=3.0, tokens=1.0)
    busy = _drive(s, 60, plain_s=4.0, verify_s=3.0, tokens=1.0)
    assert sum(busy) >= 1  # a probe ran in the busy spell
    assert s.switches == 1 and s.state()["spec_on_by_batch_size"] == {1: False}  # never back on


def test_batch_sizes_decide_apart():
    """A verify step costs more against a plain one at larger batches: each size has its own verdict."""
    s = sw.SpeculationSwitch(True)
    for _ in range(100):
        _drive(s, 1, plain_s=1.0, verify_s=1.5, tokens=2.0, batch_size=1)
        _drive(s, 1, plain_s=1.0, verify_s=4.0, tokens=2.0, batch_size=4)
    assert s.state()["spec_on_by_batch_size"] == {1: True, 4: False}


def test_disabled_switch_always_verifies_and_tp_agreement_decides():
    s = sw.SpeculationSwitch(False)
    assert all(_drive(s, 300, plain_s=1.0, verify_s=10.0, tokens=1.0))
    # Another rank measured that drafts do not pay: every rank decodes plainly.
    seen: List[bool] = []

    def agree(pays: bool) -> bool:
        seen.append(pays)
        return False

    s = sw.SpeculationSwitch(True, agree)
    chosen = _drive(s, 100, plain_s=1.0, verify_s=1.0, tokens=4.0)
    assert all(seen) and not any(chosen[4:sw.MIN_PROBE_INTERVAL + 3])


# ---------------------------------------------------------------------------------------- scheduler
class _Scripted:
    """A switch that verifies in runs: `on` decode steps verify, then `off` decode plainly."""

    def __init__(self, on: int, off: int) -> None:
        self.pattern = [True] * on + [False] * off
        self.calls = 0
        self.plain_steps = 0

    def would_verify(self, batch_size: int) -> bool:
        return self.pattern[self.calls % len(self.pattern)]

    def should_verify(self, batch_size: int) -> bool:
        verify = self.would_verify(batch_size)
        self.calls += 1
        self.plain_steps += not verify
        return verify

    def record(self, batch_size: int, verified: bool, seconds: float, tokens_per_request: float) -> None:
        pass

    def state(self) -> Dict[str, object]:
        return {}


@pytest.fixture(scope="module")
def tiny():
    from engine.builtin_model import ensure_builtin_model

    return ensure_builtin_model()


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("switch_draft"))
    build_tiny_model(path, seed=3, vocab_size=VOCAB, max_position_embeddings=2048)
    return path


def _harness(target: str, spec: Dict, **kwargs) -> Harness:
    from engine.scheduler.tp_worker import TpModelWorker

    worker_args = ServerArgs(model_path=target, device="cpu", max_total_tokens=4096,
                             page_size=kwargs.get("page_size", 1), max_running_requests=16)
    return Harness(worker=TpModelWorker(worker_args), tokenizer=LetterTokenizer(), max_total_tokens=4096, **spec, **kwargs)


def _outputs(h: Harness, prompts: List[List[int]], n_new: int) -> List[List[int]]:
    rids = [h.submit(p, max_new_tokens=n_new, ignore_eos=True) for p in prompts]
    h.run_until_idle()  # ends with the strict idle leak check
    return [h.outputs[r].output_ids for r in rids]


def _count_forwards(runner) -> List[int]:
    count = [0]
    forward = runner.forward

    def counted(batch):
        count[0] += 1
        return forward(batch)

    runner.forward = counted
    return count


def _flipping_run(target: str, spec: Dict, prompts: List[List[int]], n_new: int, **kwargs):
    """Decode with the switch flipping (3 verify steps, 4 plain ones, ...); checks that a draft
    model runs no forward on a plain decode step. Returns (outputs, internal state)."""
    h = _harness(target, dict(spec, speculative_batch_size_threshold=1024), **kwargs)
    spec_obj = h.scheduler.spec
    script = _Scripted(3, 4)
    spec_obj.switch = script
    runner = getattr(spec_obj.drafter, "runner", None)
    count = _count_forwards(runner) if runner is not None else [0]
    rids = [h.submit(p, max_new_tokens=n_new, ignore_eos=True) for p in prompts]
    while h.scheduler.has_work():
        before_calls, before_forwards = script.calls, count[0]
        h.step()
        if script.calls == before_calls + 1 and not script.pattern[before_calls % len(script.pattern)]:
            assert count[0] == before_forwards, "the draft ran on a plain decode step"
    h.step()  # the strict idle check
    assert script.plain_steps > 0
    return [h.outputs[r].output_ids for r in rids], h.scheduler.internal_state()


# The fast lane keeps the default config in both loops; page 16 and chunking run in the full suite.
@pytest.mark.parametrize("config", [pytest.param({}, id="default"), pytest.param(dict(overlap=True), id="overlap"),
                                    pytest.param(dict(page_size=16), id="page16", marks=pytest.mark.slow),
                                    pytest.param(dict(page_size=16, overlap=True), id="page16-overlap",
                                                 marks=pytest.mark.slow),
                                    pytest.param(dict(chunked_prefill_size=8), id="chunked", marks=pytest.mark.slow),
                                    pytest.param(dict(chunked_prefill_size=8, overlap=True), id="chunked-overlap",
                                                 marks=pytest.mark.slow)])
def test_flipping_switch_keeps_outputs_and_a_target_draft_accepts_everything(tiny, config):
    """STANDALONE with the draft = the target: after each run of plain steps its catch-up writes the
    K/V it skipped, so every draft is still accepted; outputs equal speculation off."""
    prompts = _prompts()
    plain = _outputs(_harness(tiny, {}, **config), prompts, 30)
    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=tiny, speculative_num_steps=3)
    outs, state = _flipping_run(tiny, spec, prompts, 30, **config)
    assert outs == plain
    assert state["spec_accepted_tokens"] == state["spec_draft_tokens"] > 0, state


@pytest.mark.parametrize("algo,overlap", [("NGRAM", False), ("STANDALONE", False), ("NGRAM", True),
                                          ("STANDALONE", True)])
def test_flipping_switch_keeps_outputs_with_a_poor_drafter(tiny, small_draft, algo, overlap):
    prompts = _prompts()
    plain = _outputs(_harness(tiny, {}, overlap=overlap), prompts, 30)
    spec: Dict = dict(speculative_algorithm=algo)
    if algo == "STANDALONE":
        spec.update(speculative_draft_model_path=small_draft, speculative_num_steps=3)
    outs, state = _flipping_run(tiny, spec, prompts, 30, overlap=overlap)
    assert outs == plain
    assert state["spec_verify_ct"] > 0


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_overlap_pipelines_plain_steps_and_verifies_with_nothing_in_flight(tiny, small_draft, algo):
    """A speculating server runs the overlap loop (issue 36): its plain decode steps are launched
    while the previous result is in flight, as a plain server's; a verify step only once every
    earlier result was processed (it drafts from their tokens); outputs equal speculation off."""
    prompts = _prompts()
    plain = _outputs(_harness(tiny, {}, overlap=True), prompts, 30)
    spec: Dict = dict(speculative_algorithm=algo, speculative_batch_size_threshold=1024)
    if algo == "STANDALONE":
        spec.update(speculative_draft_model_path=small_draft, speculative_num_steps=3)
    h = _harness(tiny, spec, overlap=True)
    assert h.scheduler.enable_overlap and not h.args.disable_overlap_schedule
    h.scheduler.spec.switch = _Scripted(3, 4)
    launcher = h.scheduler.launcher
    launch = launcher.launch
    seen: List = []  # (decode, in flight, verified) per launch

    def recorded(batch, overlap, results_in_flight):
        out = launch(batch, overlap, results_in_flight)
        seen.append((batch.forward_mode.is_decode(), results_in_flight, isinstance(out, VerifyStep)))
        return out

    launcher.launch = recorded
    assert _outputs(h, prompts, 30) == plain
    assert any(verified for _, _, verified in seen)
    assert not any(verified and in_flight for _, in_flight, verified in seen)
    assert any(decode and in_flight and not verified for decode, in_flight, verified in seen)


@pytest.mark.parametrize("overlap", [False, True])
def test_flipping_switch_eagle_head_catches_up_exactly(exact_pair, overlap):  # noqa: F811
    """The identity EAGLE head predicts the target's tokens only if its K/V at every position read
    the right token and feature: after plain runs its catch-up must restore them."""
    target, head = exact_pair
    prompts = _prompts()
    plain = _outputs(_harness(target, {}, overlap=overlap), prompts, 30)
    outs, state = _flipping_run(target, dict(speculative_algorithm="EAGLE", speculative_draft_model_path=head),
                                prompts, 30, overlap=overlap)
    assert outs == plain
    assert state["spec_accepted_tokens"] == state["spec_draft_tokens"] > 0, state


@pytest.mark.parametrize("overlap", [False, True])
def test_poor_draft_is_switched_off(tiny, small_draft, overlap):
    """A random draft is (nearly) never accepted and a verify step costs more than a plain one:
    after the warm-up the switch decodes plainly, verifying only its probes (with overlap: the plain
    steps' pipelined time against the verify steps' synchronous one)."""
    prompts = [_prompts()[1]]
    plain = _outputs(_harness(tiny, {}, overlap=overlap), prompts, 80)
    h = _harness(tiny, dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=small_draft,
                            speculative_num_steps=3), overlap=overlap)
    assert _outputs(h, prompts, 80) == plain
    state = h.scheduler.internal_state()
    assert state["spec_on_by_batch_size"] == {1: False}, state
    # 2 warm-up verify steps, then probes after 16 and 32 plain steps (a spike of a shared machine may
    # add a probe or two).
    assert 2 <= state["spec_verify_ct"] <= 6, state
    assert state["spec_switches"] >= 1
