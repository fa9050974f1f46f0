"""Speculative decoding (SGLang's --speculative-algorithm): drafts proposed cheaply, verified by
one forward of the target model, accepted so that outputs are exactly the target's.

- `ngram.py`: the NGRAM drafter (the request's own tokens propose the continuation);
- `verify.py`: which drafts a verify forward accepts (greedy and SGLang's rejection sampling);
- `ngram_worker.py`: `NgramSpeculator`, the scheduler's collaborator that runs a decode step as a
  verify step and owns the acceptance counters.
"""
