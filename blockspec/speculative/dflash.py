"""The DFlash proposer: the draft fills each row's block `[pending, MASK x (B-1)]` in one pass.

Before it drafts, the draft catches up on the rows' backlog: the target features of positions committed
by plain and prompt-lookup steps, which it has not seen yet (`Sequence.unfed_features`). Injecting k
positions costs about what injecting one does (the draft's weights are read once), and a request that
finishes while decoding plainly never pays for its backlog. At most MAX_UNFED positions wait.

Under the "rejection" acceptance rule a sampled row's block is drawn, not its argmax (proposal.py): q at a
position is softmax(score / T) over its PROPOSAL_TOPK best tokens by the target head, as a DFlash2
selector's walk would sample among its candidates; `select` is the seam a proposer with its own walk
replaces.
"""

from __future__ import annotations

import torch

from blockspec.engine.runner import ModelRunner
from blockspec.engine.sequence import Sequence
from blockspec.layers.selector import Walk, walk
from blockspec.speculative.proposal import (PROPOSAL_TOPK, AcceptRule, Proposal, proposal_uniforms,
                                            sample_ranked, temperatures)

MAX_UNFED = 64


def walked(path: Walk) -> Proposal:
    """A DFlash2 walk as a proposal: its tokens, and each step's candidates and q."""
    return Proposal(path.tokens, path.candidates.cpu(), path.q.cpu())


class DFlashProposer:
    def __init__(self, runner: ModelRunner, mask_token_id: int) -> None:
        self.runner, self.mask_token_id = runner, mask_token_id

    def catch_up(self, seqs: list[Sequence]) -> None:
        """Inject every row's unfed target features into the draft's cache."""
        self.runner.feed_draft(seqs)

    def propose(self, seqs: list[Sequence], block_size: int, rule: AcceptRule = "match") -> Proposal:
        """block_size - 1 proposed tokens per row [b, B-1] (the rows must have caught up): the argmax,
        or under "rejection" a sampled row's draw from its proposal distribution (`select`)."""
        block = self.block(seqs, block_size)
        temps = temperatures(seqs, rule)
        if not any(temps):
            return Proposal(self.runner.draft_proposals(seqs, block))
        return self.select(seqs, block, temps, proposal_uniforms(seqs, block_size - 1))

    def select(self, seqs: list[Sequence], block: torch.Tensor, temps: list[float],
               uniforms: torch.Tensor) -> Proposal:
        """Each row's tokens drawn with `uniforms` [b, B-1] at its temperature (0: the argmax) among each
        position's best tokens, with what they were drawn from; a DFlash2 draft's walk through its selector's
        lattice (each step's q given the token drawn before it)."""
        if self.runner.draft.config.dflash2 is not None:
            return walked(self.runner.draft_walk(seqs, block, torch.tensor(temps), uniforms))
        logprobs, ids = self.runner.draft_ranking(seqs, block, self.proposal_topk)
        return sample_ranked(logprobs, ids, temps, uniforms, self.runner.device)

    def sampled_tree_material(self, seqs: list[Sequence], block_size: int, k: int,
                              temps: list[float]) -> tuple[torch.Tensor, torch.Tensor, Proposal]:
        """One draft pass for trees where rows sample under "rejection" (`temps`: each row's proposal
        temperature, `temperatures`): each position's best tokens (as `rank`: k, or as many as a sampled
        proposal's candidates if more) and the sampled proposal (a sampled row's chain becomes its tree's
        spine: `tree.with_spine`)."""
        block = self.block(seqs, block_size)
        logprobs, ids = self.runner.draft_ranking(seqs, block, max(k, self.proposal_topk))
        top = self.proposal_topk
        proposal = sample_ranked(logprobs[..., :top], ids[..., :top], temps,
                                 proposal_uniforms(seqs, block_size - 1), self.runner.device)
        return logprobs, ids, proposal

    @property
    def proposal_topk(self) -> int:
        """A sampled proposal's candidates per position (fewer only for a smaller vocabulary)."""
        vocab = self.runner.draft.vocab
        size = vocab.numel() if vocab is not None else self.runner.target.config.vocab_size
        return min(PROPOSAL_TOPK, size)

    def rank(self, seqs: list[Sequence], block_size: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each drafted position's k best tokens and their log-probabilities ([b, B-1, k] each, best first),
        a tree's material (the rows must have caught up)."""
        return self.runner.draft_ranking(seqs, self.block(seqs, block_size), k)

    def selector_material(self, seqs: list[Sequence], block_size: int,
                          temps: list[float]) -> tuple[torch.Tensor, torch.Tensor, Proposal | None]:
        """One DFlash2 draft pass for selector trees: the edge scores [b, B-1, K, K], the candidates
        [b, B-1, K] and, where rows sample (`temps`, as `temperatures` gives them), their walks (each
        sampled row's tree grows around its walk: selector_tree.py), else None."""
        scores, candidates = self.runner.draft_lattice(seqs, self.block(seqs, block_size))
        if not any(temps):
            return scores, candidates, None
        uniforms = proposal_uniforms(seqs, block_size - 1)
        return scores, candidates, walked(walk(scores, candidates, torch.tensor(temps), uniforms))

    def block(self, seqs: list[Sequence], block_size: int) -> torch.Tensor:
        """[pending, MASK x (B-1)] per row."""
        block = torch.full((len(seqs), block_size), self.mask_token_id, device=self.runner.device)
        block[:, 0] = torch.tensor([s.pending_token for s in seqs], device=self.runner.device)
        return block
