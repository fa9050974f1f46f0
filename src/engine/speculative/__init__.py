"""Speculative decoding (SGLang's --speculative-algorithm): drafts proposed cheaply, verified by
one forward of the target model, accepted so that outputs are exactly the target's.

- `speculator.py`: `Speculator`, the scheduler's collaborator that runs a decode step as a verify
  step and owns the acceptance counters;
- `step.py`: `VerifyStep` (one step from launch to processing) and the `Drafter` protocol;
- `ngram.py`: the NGRAM drafter (the request's own tokens propose the continuation);
- `draft_model.py`: the STANDALONE drafter (a draft model whose K/V follow the target's slots);
- `verify.py`: which drafts a verify forward accepts (greedy and SGLang's rejection sampling);
- `sampling.py`: penalties, logit_bias and grammar masks at every verified position, and the
  emitted tokens' logprobs, as the plain decode step would have them;
- `tree.py`: tree drafts (--speculative-eagle-topk > 1): growth, selection, mask, tree acceptance.
- `switch.py`: `SpeculationSwitch`, whether eligible decode steps verify (measured cost vs accept length);
- `memory.py`: a draft model's bytes per slot and weights, budgeted with the target's KV pool.
"""
