"""The DFlash proposer: the draft fills each row's block `[pending, MASK x (B-1)]` in one pass.

Before it drafts, the draft catches up on the rows' backlog: the target features of positions committed
by plain and prompt-lookup steps, which it has not seen yet (`Sequence.unfed_features`). Injecting k
positions costs about what injecting one does (the draft's weights are read once), and a request that
finishes while decoding plainly never pays for its backlog. At most MAX_UNFED positions wait.
"""

from __future__ import annotations

import torch

from blockspec.engine.runner import ModelRunner
from blockspec.engine.sequence import Sequence

MAX_UNFED = 64


class DFlashProposer:
    def __init__(self, runner: ModelRunner, mask_token_id: int) -> None:
        self.runner, self.mask_token_id = runner, mask_token_id

    def catch_up(self, seqs: list[Sequence]) -> None:
        """Inject every row's unfed target features into the draft's cache."""
        self.runner.feed_draft(seqs)

    def propose(self, seqs: list[Sequence], block_size: int) -> torch.Tensor:
        """block_size - 1 proposed tokens per row [b, B-1] (the rows must have caught up)."""
        return self.runner.draft_proposals(seqs, self.block(seqs, block_size))

    def rank(self, seqs: list[Sequence], block_size: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each drafted position's k best tokens and their log-probabilities ([b, B-1, k] each, best first),
        a tree's material (the rows must have caught up)."""
        return self.runner.draft_ranking(seqs, self.block(seqs, block_size), k)

    def lattice(self, seqs: list[Sequence], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A DFlash2 draft's edge scores [b, B-1, K, K] and candidates [b, B-1, K] (a selector tree's
        material; the rows must have caught up)."""
        return self.runner.draft_lattice(seqs, self.block(seqs, block_size))

    def block(self, seqs: list[Sequence], block_size: int) -> torch.Tensor:
        """[pending, MASK x (B-1)] per row."""
        block = torch.full((len(seqs), block_size), self.mask_token_id, device=self.runner.device)
        block[:, 0] = torch.tensor([s.pending_token for s in seqs], device=self.runner.device)
        return block
