"""Tree drafts (--speculative-eagle-topk > 1): how a draft model grows each request's tree, which
nodes the target verifies, the tree attention mask, and which path it accepts.

Growing (SGLang's EAGLEWorker.draft_forward with select_top_k_tokens): the draft's forward at the
root (the request's last token) gives its topk most likely children; each of the next num_steps - 1
steps feeds the topk current leaves (each its own query row attending to the request's prefix and
its own ancestors only: the tree mask) and expands each leaf by its topk children, the topk^2
children being candidates scored by their cumulative log-probability, of which the topk best are
the next leaves. Candidates: topk + (num_steps - 1) * topk^2, depth <= num_steps.

Selection (SGLang's organize_draft_results / build_tree_kernel_efficient): the num_draft_tokens - 1
candidates of highest cumulative score, in candidate order, under the root. A child scores at
most its parent (log-probabilities are <= 0) and comes later, so a stable sort by score picks a
parent whenever it picks its child: the selection is a tree.

Verification: node 0 is the last token, nodes 1.. the selected drafts in candidate order (parents
first); node i sits at position prefix + depth(i) and attends to the prefix and to its ancestors
and itself among the nodes. Acceptance: greedy follows, from the root, the child whose token is
the target's argmax at its parent, and adds the argmax after the last one (the bonus); sampled
requests follow SGLang's tree_speculative_sampling_target_only: at each node one uniform coin
walks its children in order, accepting the child where the running sum of the target's
probabilities of the children's tokens passes the coin; when none does, the token is drawn from the
target's distribution without the children's tokens (renormalised). The accepted child is
therefore child c with probability p(c), and any other token t with probability
(1 - sum p(children)) * p(t) / (1 - sum p(children)) = p(t): the output is distributed as the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from engine.kernels import ops as kernel_ops
from engine.model_executor.forward_batch_info import ForwardMode, ModelWorkerBatch
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.speculative.verify import VerifyOutcome, target_probs


@dataclass(frozen=True)
class TreeShape:
    """--speculative-num-steps, --speculative-eagle-topk, --speculative-num-draft-tokens."""

    num_steps: int
    topk: int
    num_draft_tokens: int

    @property
    def num_drafts(self) -> int:
        """The drafts one request verifies (the tree's nodes under the root)."""
        return self.num_draft_tokens - 1

    @property
    def fed_nodes(self) -> int:
        """The nodes a drafter feeds after the root (the leaves of steps 1 .. num_steps - 1)."""
        return (self.num_steps - 1) * self.topk

    @property
    def slots(self) -> int:
        """KV slots one drafting request takes after its last token: the verified drafts', and the
        draft's scratch for the fed nodes (positions after the root's), whichever is more."""
        return max(self.num_drafts, self.fed_nodes)


@dataclass
class DraftTree:
    """One request's verified tree: node 0 is its last token, node i >= 1 is draft tokens[i - 1]."""

    tokens: List[int]
    parents: List[int]  # per draft: its parent node (0: the root), always an earlier node

    def depths(self) -> List[int]:
        """Per node (the root included): its depth, the root's 0."""
        depth = [0]
        for p in self.parents:
            depth.append(depth[p] + 1)
        return depth

    def children(self) -> List[List[int]]:
        """Per node: its children in node order."""
        kids: List[List[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parents):
            kids[p].append(i + 1)
        return kids

    def mask(self) -> torch.Tensor:
        """[nodes, nodes] bool: node i attends to node j iff j is i or one of its ancestors."""
        n = len(self.tokens) + 1
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            mask[i + 1] |= mask[p]
        return mask


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool over n fed nodes whose parents (index among them, -1: the root, which the
    prefix holds) come first: each node sees its ancestors and itself."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def fed_nodes_batch(pool_rows: List[int], table: torch.Tensor, roots: List[int], tokens: List[List[int]],
                    parents: List[List[int]], depths: List[List[int]], new: int) -> ModelWorkerBatch:
    """A draft's forward over each request's `new` newest fed nodes (the current leaves; the
    earlier ones were written by the previous steps): an extend after the earlier nodes, into the
    scratch slots the request's row holds after its root (at position roots[r]), node j at position
    root + depth; each new node sees the prefix up to its root, and among the fed nodes its
    ancestors and itself (the mask covers every fed node); every row's logits kept."""
    fed = [len(t) for t in tokens]
    prefix = [root + 1 + n - new for root, n in zip(roots, fed)]
    seq_lens = [root + 1 + n for root, n in zip(roots, fed)]
    slots = torch.cat([table[row, p:p + new] for row, p in zip(pool_rows, prefix)]).to(torch.int64)
    return ModelWorkerBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, input_ids=torch.tensor([t for ts in tokens for t in ts[-new:]]),
        req_pool_indices=torch.tensor(pool_rows, dtype=torch.int64), seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=seq_lens, out_cache_loc=slots.cpu(), extend_num_tokens=new * len(fed),
        extend_seq_lens=[new] * len(fed), extend_prefix_lens=prefix,
        positions=torch.tensor([root + d for root, ds in zip(roots, depths) for d in ds[-new:]], dtype=torch.int64),
        spec_tree_mask=torch.cat([ancestor_mask(p)[-new:].reshape(-1) for p in parents]), spec_tree_widths=fed)


def newest_rows(logits: torch.Tensor, n_rows: int, topk: int) -> torch.Tensor:
    """[R, topk, vocab]: the rows of a fed_nodes_batch forward per request."""
    return logits.view(n_rows, topk, logits.shape[-1])


# The drafter's forwards the growth needs (speculative/eagle.py, draft_model.py implement them):
# root(rows) -> logits [R, vocab] at each drafting request's root;
# fed(rows, tokens [R][F], parents [R][F] (index among the fed nodes, -1: the root), depths [R][F])
#     -> logits [R, topk, vocab] of the last topk fed nodes of each request (the current leaves; the
#     earlier ones were fed by the previous calls: fed_nodes_batch feeds the new ones only).
RootForward = Callable[[List[int]], torch.Tensor]
FedForward = Callable[[List[int], List[List[int]], List[List[int]], List[List[int]]], torch.Tensor]


def grow_trees(shape: TreeShape, rows: List[int], root: RootForward, fed: FedForward) -> List[DraftTree]:
    """The verified tree of each drafting request (`rows`: their indices in the batch)."""
    topk, n_rows = shape.topk, len(rows)
    logp = torch.log_softmax(root(rows).float(), dim=-1)
    scores, tokens = logp.topk(topk, dim=-1)  # [R, topk]
    # Candidates so far, per request: cumulative score, token, parent candidate (-1: the root), depth.
    cand_scores = [scores]
    cand_tokens = [tokens]
    cand_parents = [torch.full((n_rows, topk), -1, dtype=torch.int64)]
    leaves = torch.arange(topk).expand(n_rows, topk)  # candidate index of each current leaf
    leaf_scores = scores
    # The fed nodes (leaves of earlier steps), per request: token, parent among fed (-1 root), depth.
    fed_tokens: List[List[int]] = [[] for _ in rows]
    fed_parents: List[List[int]] = [[] for _ in rows]
    fed_depths: List[List[int]] = [[] for _ in rows]
    fed_of_cand: List[dict] = [{} for _ in rows]  # candidate index -> its index among the fed nodes
    all_parents = torch.cat(cand_parents, dim=1)
    for step in range(1, shape.num_steps):
        all_tokens = torch.cat(cand_tokens, dim=1)
        all_parents = torch.cat(cand_parents, dim=1)
        for r in range(n_rows):
            for c in leaves[r].tolist():
                parent = int(all_parents[r, c])
                fed_of_cand[r][c] = len(fed_tokens[r])
                fed_tokens[r].append(int(all_tokens[r, c]))
                fed_parents[r].append(fed_of_cand[r][parent] if parent >= 0 else -1)
                fed_depths[r].append(step)
        child_logp = torch.log_softmax(fed(rows, fed_tokens, fed_parents, fed_depths).float(), dim=-1)
        child_scores, child_tokens = child_logp.topk(topk, dim=-1)  # [R, topk leaves, topk children]
        expanded = (leaf_scores.unsqueeze(2) + child_scores).reshape(n_rows, topk * topk)
        base = sum(t.shape[1] for t in cand_tokens)
        cand_scores.append(expanded)
        cand_tokens.append(child_tokens.reshape(n_rows, topk * topk))
        cand_parents.append(leaves.unsqueeze(2).expand(n_rows, topk, topk).reshape(n_rows, topk * topk))
        leaf_scores, best = expanded.topk(topk, dim=-1)
        leaves = best + base
    all_scores = torch.cat(cand_scores, dim=1).tolist()
    all_tokens_l = torch.cat(cand_tokens, dim=1).tolist()
    all_parents_l = torch.cat(cand_parents, dim=1).tolist()
    trees: List[DraftTree] = []
    for r in range(n_rows):
        order = sorted(range(len(all_scores[r])), key=lambda c: (-all_scores[r][c], c))
        chosen = sorted(order[: shape.num_drafts])
        node_of = {c: i + 1 for i, c in enumerate(chosen)}
        parents: List[int] = []
        for c in chosen:
            p = all_parents_l[r][c]
            # Stable order by score: a chosen child's parent (an earlier, not lower score) is chosen.
            assert p < 0 or p in node_of, "tree selection lost a parent"
            parents.append(node_of[p] if p >= 0 else 0)
        trees.append(DraftTree(tokens=[all_tokens_l[r][c] for c in chosen], parents=parents))
    return trees


def verify_layout(trees: Sequence[Optional[DraftTree]], last_tokens: Sequence[int], prefix_lens: Sequence[int]
                  ) -> Tuple[List[int], torch.Tensor, torch.Tensor]:
    """The verify forward's input ids, positions and flat tree mask (each request's [nodes, nodes]
    block, row-major, in batch order); a request without a tree verifies its last token alone."""
    ids: List[int] = []
    positions: List[int] = []
    masks: List[torch.Tensor] = []
    for tree, last, m in zip(trees, last_tokens, prefix_lens):
        ids.append(last)
        if tree is None:
            positions.append(m)
            masks.append(torch.ones(1, dtype=torch.bool))
            continue
        ids.extend(tree.tokens)
        positions.extend(m + d for d in tree.depths())
        masks.append(tree.mask().reshape(-1))
    return ids, torch.tensor(positions, dtype=torch.int64), torch.cat(masks)


@dataclass
class TreeOutcome:
    outcome: VerifyOutcome
    paths: List[List[int]]  # per request: the accepted nodes after the root, in order


def accept_tree(logits: torch.Tensor, trees: Sequence[Optional[DraftTree]], info: SamplingBatchInfo) -> TreeOutcome:
    """`logits` [sum(nodes), vocab]: each request's rows in node order (a request without a tree:
    its last token's row alone); `info` one row of sampling parameters per request."""
    logits = logits[:, : info.vocab_size].float()
    counts = [1 + (len(t.tokens) if t is not None else 0) for t in trees]
    starts: List[int] = []
    pos = 0
    for c in counts:
        starts.append(pos)
        pos += c
    greedy_ids = kernel_ops.greedy(logits).tolist()
    row_greedy = (info.top_ks == 1).tolist()
    sampled = [i for i, g in enumerate(row_greedy) if not g]
    probs: Optional[torch.Tensor] = None
    local: dict = {}
    if sampled:
        rows = torch.cat([torch.arange(starts[i], starts[i] + counts[i]) for i in sampled])
        owner = torch.repeat_interleave(torch.arange(len(sampled)), torch.tensor([counts[i] for i in sampled]))
        device = logits.device
        probs = target_probs(logits[rows.to(device)], info, torch.tensor(sampled, device=device),
                             owner.to(device)).cpu()
        offset = 0
        for i in sampled:
            local[i] = offset
            offset += counts[i]
    tokens: List[List[int]] = []
    paths: List[List[int]] = []
    for i, tree in enumerate(trees):
        children = tree.children() if tree is not None else [[]]
        node_tokens = [0] + (tree.tokens if tree is not None else [])
        path: List[int] = []
        cur = 0
        if row_greedy[i]:
            while True:
                want = greedy_ids[starts[i] + cur]
                nxt = next((c for c in children[cur] if node_tokens[c] == want), None)
                if nxt is None:
                    break
                path.append(nxt)
                cur = nxt
            last = greedy_ids[starts[i] + cur]
        else:
            assert probs is not None  # computed for every sampled request
            last = -1
            while last < 0:
                p = probs[local[i] + cur]
                coin = float(torch.rand(()))
                acc = 0.0
                nxt = None
                for c in children[cur]:
                    acc += float(p[node_tokens[c]])
                    if coin < acc:
                        nxt = c
                        break
                if nxt is not None:
                    path.append(nxt)
                    cur = nxt
                    continue
                residual = p.clone()
                residual[[node_tokens[c] for c in children[cur]]] = 0.0
                if float(residual.sum()) <= 0.0:  # the children held all the mass up to rounding
                    residual = p
                last = int(torch.multinomial(residual, 1))
        paths.append(path)
        tokens.append([node_tokens[c] for c in path] + [last])
    return TreeOutcome(VerifyOutcome(tokens=tokens, accepted=[len(p) for p in paths]), paths)


def path_moves(paths: Sequence[List[int]], starts: Sequence[int]) -> Tuple[List[int], List[int]]:
    """(src, dst) rows of the verify batch: accepted node n_s (s-th on the path) moves to row
    start + s, so the path lies right after the root as a chain would."""
    src: List[int] = []
    dst: List[int] = []
    for path, start in zip(paths, starts):
        for s, node in enumerate(path, start=1):
            if node != s:
                src.append(start + node)
                dst.append(start + s)
    return src, dst
