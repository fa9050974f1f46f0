"""What a verify step samples beyond the batch's plain parameters, exactly as the plain decode step
would: penalties, min_new_tokens, logit_bias and a grammar at every verified position, and the
logprobs of the tokens it emits.

Position p of a request's verify rows is node p of its draft tree (a chain is the tree whose node j
has parent j - 1; node 0 is the request's last token) and predicts the token after it. A plain
decode step would predict that token with the request's state after the tokens on the path from
the root to p had been accepted, so at each position:
- penalties and min_new_tokens count the path's drafts as generated (SamplingBatchInfo.per_position
  copies the batch's penalty state per position), and logit_bias applies as usual (SGLang gives
  every position the state before the step: not exact, which this is);
- the grammar's mask is the matcher's after the path: the matcher walks the tree depth first
  (accept a child's token, fill the child's row, go back) and ends where it started; a draft the
  grammar rejects is not walked past, which ends the chain there (the parent's row excludes that
  token, so neither greedy nor rejection sampling accepts it, and the rows under it are never read);
- these are applied to the verify logits in place, in the sampler's order (apply_logits_bias), so the
  acceptance (verify.py, tree.py) reads the very distribution the plain step would sample from;
- each emitted token's logprob comes from the processed logits of the row that predicted it, by
  the sampler's own fill_logprobs / fill_token_ids_logprobs (the plain step's normalisation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import torch

from engine.constrained.vocab_mask import allocate_vocab_mask, needs_vocab_mask
from engine.layers.logits_processor import LogitsProcessorOutput
from engine.layers.sampler import fill_logprobs, fill_token_ids_logprobs
from engine.speculative.tree import DraftTree

if TYPE_CHECKING:
    from engine.constrained.base_grammar_backend import BaseGrammarObject
    from engine.sampling.sampling_batch_info import SamplingBatchInfo
    from engine.scheduler.req import Req

# A request's logprob ask: (top_logprobs_num, token_ids_logprob).
LogprobAsk = Tuple[int, Optional[List[int]]]


def supports(req: Req) -> bool:
    """Whether a verify step samples this request as its plain decode step would. Seeded sampling
    (its noise is keyed by the step counter, which a verify step would have to advance per position)
    and custom logit processors (arbitrary code that sees one row per request) stay plain, as do
    hidden states (not captured per verified position) and a grammar that cannot roll back."""
    sp = req.sampling_params
    return (not req.return_hidden_states and req.custom_logit_processor is None and sp.sampling_seed is None
            and (req.grammar is None or req.grammar.supports_rollback))


@dataclass
class VerifySampling:
    """Taken from the batch's requests when the step is prepared (scheduling thread); used on the
    forward thread while the scheduling thread waits for the step."""

    # Whether a request has a penalty, min_new_tokens or logit_bias (its logits change per position).
    adjusts_logits: bool
    # Per request: its live matcher (None: unconstrained).
    grammars: List[Optional[BaseGrammarObject]]
    # Per request: what it asks of logprobs (None: none).
    logprobs: List[Optional[LogprobAsk]]
    # Per request: its output ids (the Req's own list, unchanged while the step runs).
    outputs: List[List[int]]

    @classmethod
    def of(cls, reqs: Sequence[Req]) -> Optional["VerifySampling"]:
        """None when every request samples plainly (nothing to do per position)."""
        adjusts = any(_adjusts_logits(r) for r in reqs)
        grammars = [r.grammar if needs_vocab_mask(r) else None for r in reqs]
        logprobs: List[Optional[LogprobAsk]] = [(r.top_logprobs_num, r.token_ids_logprob) if r.return_logprob
                                                 else None for r in reqs]
        if not adjusts and not any(g is not None for g in grammars) and not any(a is not None for a in logprobs):
            return None
        return cls(adjusts_logits=adjusts, grammars=grammars, logprobs=logprobs, outputs=[r.output_ids for r in reqs])

    def apply(self, logits: torch.Tensor, info: SamplingBatchInfo, trees: Sequence[DraftTree]) -> None:
        """Penalties, min_new_tokens, logit_bias and grammar masks at every position, in place on
        the verify logits [sum(nodes), >= vocab] (each request's rows in node order)."""
        has_grammar = any(g is not None for g in self.grammars)
        if not self.adjusts_logits and not has_grammar:
            return
        rows: List[int] = []
        gen_rows: List[int] = []
        gen_tokens: List[int] = []
        for i, tree in enumerate(trees):
            base = len(rows)
            rows.extend([i] * (1 + len(tree.tokens)))
            for node, path in enumerate(_paths(tree)):
                gen_rows.extend([base + node] * len(path))
                gen_tokens.extend(path)
        positions = info.per_position(rows, gen_rows, gen_tokens)
        if has_grammar:
            positions.vocab_mask = self._grammar_masks(trees, len(rows), info.vocab_size)
        positions.apply_logits_bias(logits)

    def _grammar_masks(self, trees: Sequence[DraftTree], n_rows: int, vocab_size: int) -> torch.Tensor:
        mask = allocate_vocab_mask(n_rows, vocab_size)
        start = 0
        for grammar, output_ids, tree in zip(self.grammars, self.outputs, trees):
            if grammar is not None:
                walk_grammar(grammar, output_ids, tree, mask, start)
            start += 1 + len(tree.tokens)
        return mask

    def emitted_logprobs(self, logits: torch.Tensor, trees: Sequence[DraftTree], paths: Sequence[List[int]],
                         tokens: Sequence[List[int]]) -> Tuple[Optional[LogitsProcessorOutput], List[int]]:
        """The logprobs of the emitted tokens of the requests that asked for them: one row per
        token, request after request; and per request the row of its first token (-1: not asked).
        `paths[i]`: the accepted nodes of request i (its emitted tokens but the last are theirs);
        `logits`: the processed verify logits."""
        picked: List[int] = []
        first_rows: List[int] = []
        token_ids: List[int] = []
        top_nums: List[int] = []
        ids_asked: List[Optional[List[int]]] = []
        start = 0
        for ask, tree, path, toks in zip(self.logprobs, trees, paths, tokens):
            if ask is None:
                first_rows.append(-1)
            else:
                first_rows.append(len(picked))
                # Token s was predicted at the node before it on the path (the root for the first).
                picked.extend(start + node for node in ([0] + list(path))[:len(toks)])
                token_ids.extend(toks)
                top_nums.extend([ask[0]] * len(toks))
                ids_asked.extend([ask[1]] * len(toks))
            start += 1 + len(tree.tokens)
        if not picked:
            return None, first_rows
        device = logits.device
        rows_logits = logits[torch.tensor(picked, device=device)]
        # As the sampler: over the (penalised, biased, masked) logits, not the tempered ones.
        logprobs = torch.log_softmax(rows_logits, dim=-1)
        out = LogitsProcessorOutput(next_token_logits=rows_logits)
        fill_logprobs(out, logprobs, torch.tensor(token_ids, dtype=torch.int64, device=device), top_nums)
        fill_token_ids_logprobs(out, logprobs, ids_asked)
        return out, first_rows


def chain_trees(drafts: Sequence[Sequence[int]]) -> List[DraftTree]:
    """Chains of drafts as trees: draft j (node j + 1) under node j."""
    return [DraftTree(tokens=list(d), parents=list(range(len(d)))) for d in drafts]


def chain_paths(accepted: Sequence[int]) -> List[List[int]]:
    """The accepted nodes of chains that accepted `accepted[i]` drafts."""
    return [list(range(1, a + 1)) for a in accepted]


def walk_grammar(grammar: BaseGrammarObject, output_ids: Sequence[int], tree: DraftTree, mask: torch.Tensor,
                 start: int) -> None:
    """Fill rows start .. start + len(tree.tokens) of `mask` with the grammar's next-token mask after
    each node's path (rows under a draft the grammar rejects, or after which it has terminated, keep
    their all-allowed default: they are never read). The matcher, at the state after `output_ids`,
    ends where it started."""
    children = tree.children()
    walked: List[int] = []  # the tokens accepted on the way down, for a backend that cannot go back
    # Depth first with an explicit stack: (node, whether its token is accepted and must be undone).
    grammar.fill_vocab_mask(mask, start)
    stack: List[Tuple[int, bool]] = [(c, False) for c in reversed(children[0])]
    while stack:
        node, leaving = stack.pop()
        if leaving:
            _go_back(grammar, output_ids, walked)
            continue
        token = tree.tokens[node - 1]
        if not grammar.accept_token(token):
            continue  # rejected: its subtree is not walked
        walked.append(token)
        stack.append((node, True))
        if grammar.is_terminated():
            continue  # a stop token ends the request there: nothing after it is emitted
        grammar.fill_vocab_mask(mask, start + node)
        stack.extend((c, False) for c in reversed(children[node]))


def _go_back(grammar: BaseGrammarObject, output_ids: Sequence[int], walked: List[int]) -> None:
    walked.pop()
    if not grammar.rollback(1):
        # supports() keeps grammars that cannot roll back plain; one that refuses anyway is
        # brought back by a replay (exact, only slower).
        grammar.sync_with(list(output_ids) + walked)


def _paths(tree: DraftTree) -> List[List[int]]:
    """Per node (the root first): the draft tokens on the path from the root to it, itself included."""
    paths: List[List[int]] = [[]]
    for token, parent in zip(tree.tokens, tree.parents):
        paths.append(paths[parent] + [token])
    return paths


def _adjusts_logits(req: Req) -> bool:
    sp = req.sampling_params
    return (bool(sp.logit_bias) or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0
            or sp.repetition_penalty != 1.0 or sp.min_new_tokens > 0)
