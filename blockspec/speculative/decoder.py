"""One decode step for every running request, read top to bottom: plan, propose, verify, accept, commit.

Every step verifies, per row, its pending token plus some candidates in one causal pass of the target:
none (a plain step), the DFlash draft's block, a continuation copied from the row's own context (prompt
lookup), or the two together as one tree (merge.py). Acceptance keeps the longest run of candidates the
target agrees with (greedy) or would have sampled (sampled, lossless: "match"), or judges sampled
proposals against their proposal distributions ("rejection", rejection.py), and the target's own next token
follows it. So whatever the plan, the output is exactly the target's; plans differ only in how many tokens
a step commits and what the step costs, which is all the governor weighs.
"""

from __future__ import annotations

import time

import torch

from blockspec.cpu_load import LoadAwareThreads
from blockspec.engine.runner import ModelRunner, guarded
from blockspec.engine.sequence import Sequence
from blockspec.speculative.accept import Outcome, accept, accept_trees
from blockspec.speculative.dflash import MAX_UNFED, DFlashProposer
from blockspec.speculative.governor import SpecGovernor
from blockspec.speculative.lookup import lookups
from blockspec.speculative.merge import MergedTree
from blockspec.speculative.plan import DraftShape, Speculation, StepPlan, choose_plan
from blockspec.speculative.proposal import AcceptRule, Drawn, temperatures
from blockspec.speculative.selector_tree import selector_tree
from blockspec.speculative.tree import Tree, build_tree, with_spine

# a step's candidates, its trees, its merged rows and per row its sampled nodes (Decoder.propose)
Candidates = tuple[torch.Tensor, list[Tree] | None, dict[int, MergedTree], list[dict[int, Drawn]]]


class Decoder:
    """Decodes a batch one step at a time: speculatively with `speculation` (a DFlash draft, prompt lookup
    and, unless `governor` is None, adaptive plain steps), or plainly when it is None."""

    def __init__(self, runner: ModelRunner, speculation: Speculation | None = None,
                 governor: SpecGovernor | None = None, threads: LoadAwareThreads | None = None) -> None:
        """`threads`: the CPU thread count to follow other processes' load with, between steps."""
        if speculation is not None and runner.draft is None:
            raise ValueError("Decoder: speculative decoding needs a runner with a DFlash draft.")
        self.runner, self.speculation, self.governor, self.threads = runner, speculation, governor, threads
        self.draft = DFlashProposer(runner, speculation.mask_token_id) if speculation is not None else None
        self.last_plan: StepPlan | None = None  # the latest step's plan (the server's live view shows it)

    @property
    def speculative(self) -> bool:
        return self.speculation is not None

    @property
    def step_width(self) -> int:
        """The most rows one step writes past a sequence's cache length."""
        return self.speculation.step_width if self.speculation is not None else 1

    def decode(self, seqs: list[Sequence]) -> None:
        if self.threads is not None:
            self.threads.tick()
        plan = self.last_plan = self.plan(seqs)
        start = time.perf_counter()
        alone = self.run(seqs, plan)
        if self.governor is not None and self.speculation is not None:  # the step ended in a host sync
            seconds = time.perf_counter() - start
            if self.runner.tp is not None:  # every rank's governor learns rank 0's time: they plan alike
                seconds = self.runner.tp.broadcast_float(seconds)
            self.governor.record(plan, seqs, seconds, alone)

    def plan(self, seqs: list[Sequence]) -> StepPlan:
        spec = self.speculation
        if spec is None:
            return StepPlan.plain(len(seqs), capture=False)
        copies = [[]] * len(seqs)
        if spec.lookup_ngram:
            copies = lookups(seqs, spec.lookup_ngram, spec.lookup_width - 1)
        return choose_plan(seqs, copies, spec, self.governor)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], plan: StepPlan) -> dict[int, tuple[int, int]]:
        """Run a planned step; returns, per merged row that committed, the tokens its draft's candidates
        alone and its copy alone would have committed (MergedTree.alone: the governor's counterfactuals)."""
        runner, device = self.runner, self.runner.device
        starts = [s.num_cached for s in seqs]

        # 1. Propose: each row's candidates [b, width - 1], and with trees each row's tree over them. The
        #    draft first catches up on what plain and lookup steps committed since it last ran, for every
        #    row: this step's features go straight in.
        if plan.drafts:
            self.draft.catch_up(seqs)
        candidates, trees, merged, drawn = self.propose(seqs, plan)
        rule = self.speculation.accept if self.speculation is not None else "match"

        # 2. Verify: one target pass over [pending, candidates...] per row (trees: each node seeing its
        #    ancestors).
        pending = torch.tensor([[s.pending_token] for s in seqs], device=device)
        parents = None if trees is None else [tree.parents for tree in trees]
        hidden, features = runner.target_pass(seqs, torch.cat([pending, candidates], dim=1), plan.capture,
                                              parents)

        # 3. Accept: per row, the candidates the target keeps (their places in the row) and its own token
        #    after them. A tree is walked from its root, the target's outputs computed where the walk goes.
        host = candidates.cpu()
        if trees is None:
            targets = runner.target_choices(seqs, hidden)
            outcomes = [guarded(seq, lambda: accept_chain(seq, host[row, :n], targets[row], rule, drawn[row]))
                        for row, (seq, n) in enumerate(zip(seqs, plan.judged))]
        else:
            def outputs(wanted: list[tuple[int, int]]) -> list[torch.Tensor]:
                rows, nodes = [row for row, _ in wanted], [node for _, node in wanted]
                return runner.target_choices([seqs[row] for row in rows], hidden[rows, nodes])

            outcomes = accept_trees(seqs, trees, outputs, rule, drawn)

        # 4. Commit: the accepted tokens and the bonus; the cache keeps exactly them (rows past the new
        #    length are scratch; a tree's accepted nodes move to consecutive rows first). The draft takes
        #    the features now if it ran, else they wait on the sequence.
        paths = [[] if outcome is None else outcome[0] for outcome in outcomes]
        if trees is not None:
            runner.keep_paths(seqs, paths)
            kept = [[0] + path + [0] * (candidates.shape[1] - len(path)) for path in paths]
            features = features.gather(1, torch.tensor(kept, device=device).unsqueeze(-1).expand(
                -1, -1, features.shape[-1]))
        if plan.drafts:
            runner.inject(seqs, features, starts)
        alone, drafted_trees = {}, plan.shape is not None and plan.shape.tree_budget > 0
        for row, (seq, outcome) in enumerate(zip(seqs, outcomes)):
            if outcome is None:  # the request failed: it leaves at the end of the step
                continue
            path, bonus, logits = outcome
            seq.num_cached += len(path) + 1
            tally(seq, plan.sources[row], len(path) + 1, plan.capture, drafted_trees)
            if plan.capture and not plan.drafts:
                seq.unfed_features.extend(features[row, : len(path) + 1].unbind(0))
            proposers = plan.sources[row]
            if row in merged:  # each accepted token's proposer: the draft, or the copy alone
                proposers, alone[row] = merged[row].sources(path), merged[row].alone(path)
            seq.emit([int(host[row, node - 1]) for node in path] + [bonus], proposers, logits)
        if plan.capture and not plan.drafts and max(len(s.unfed_features) for s in seqs) >= MAX_UNFED:
            self.draft.catch_up(seqs)
        return alone

    def propose(self, seqs: list[Sequence], plan: StepPlan) -> Candidates:
        """Candidates [b, width - 1]: the draft's block (or a tree's nodes) for drafted rows, the copy for
        lookup rows, padded with the mask token where a row has fewer than the step's width; with trees, each
        row's tree (a copy is a chain, a plain row an empty tree) and each merged row's MergedTree; per row,
        its sampled nodes and their distributions (for the rejection rule; chains: candidate i is node
        i + 1)."""
        spec, device = self.speculation, self.runner.device
        drafted = [row for row, source in enumerate(plan.sources) if source in ("draft", "merged")]
        if plan.trees:
            return self.propose_trees(seqs, plan, drafted)
        if plan.kind == "dflash":
            proposal = self.draft.propose(seqs, spec.block_size, spec.accept)
            return proposal.tokens, None, {}, [proposal.drawn(row) for row in range(len(seqs))]
        pad = spec.mask_token_id if spec else 0
        candidates = torch.full((len(seqs), plan.width - 1), pad, device=device)
        drawn: list[dict[int, Drawn]] = [{} for _ in seqs]
        if drafted:
            proposal = self.draft.propose([seqs[r] for r in drafted], spec.block_size, spec.accept)
            candidates[drafted, : spec.block_size - 1] = proposal.tokens
            for i, row in enumerate(drafted):
                drawn[row] = proposal.drawn(i)
        for row, copy in enumerate(plan.copies):
            if copy:
                candidates[row, : len(copy)] = torch.tensor(copy, device=device)
        return candidates, None, {}, drawn

    def propose_trees(self, seqs: list[Sequence], plan: StepPlan, drafted: list[int]) -> Candidates:
        """Each drafted row's tree (draft_trees); a copy is a chain; a merged row's copy joins its draft's
        tree. The candidates are as wide as the largest tree (a merged tree is narrower than the plan's
        bound where its copy and its draft agree)."""
        spec = self.speculation
        trees = [Tree.chain(list(copy)) for copy in plan.copies]
        drawn: list[dict[int, Drawn]] = [{} for _ in seqs]
        for row, (tree, nodes) in zip(drafted, self.draft_trees([seqs[r] for r in drafted], plan.shape)):
            trees[row], drawn[row] = tree, nodes
        merged = {row: MergedTree.of(trees[row], list(plan.copies[row]))
                  for row, source in enumerate(plan.sources) if source == "merged"}
        for row, tree in merged.items():
            trees[row] = tree.tree
            drawn[row] = {tree.placed[node - 1]: dist for node, dist in drawn[row].items()}
        width = max(tree.size for tree in trees)
        rows = [list(tree.tokens) + [spec.mask_token_id] * (width - tree.size) for tree in trees]
        return torch.tensor(rows, device=self.runner.device), trees, merged, drawn

    def draft_trees(self, seqs: list[Sequence], shape: DraftShape) -> list[tuple[Tree, dict[int, Drawn]]]:
        """The draft's candidates per row as a tree, with its sampled nodes: from its top-k per position
        (tree.py) or a DFlash2 draft's selector (`selector_trees`), or its chain where the shape is one (a
        merged step's draft side). Under "rejection" a sampled row's tree is built spine-first on its
        sampled chain (rejection.py: the other nodes are deterministic proposals)."""
        spec, k = self.speculation, self.speculation.tree_topk
        if not seqs:
            return []
        if not shape.tree_budget:
            proposal = self.draft.propose(seqs, spec.block_size, spec.accept)
            return [(Tree.chain(row), proposal.drawn(i)) for i, row in enumerate(proposal.tokens.tolist())]
        if self.runner.draft.config.dflash2 is not None:
            return self.selector_trees(seqs, shape)
        temps = temperatures(seqs, spec.accept)
        if not any(temps):
            logprobs, ids = self.draft.rank(seqs, spec.block_size, k)
            return [(build_tree(logp, ranked, shape.tree_budget, spec.tree_rule), {})
                    for logp, ranked in zip(logprobs.cpu(), ids.cpu())]
        logprobs, ids, proposal = self.draft.sampled_tree_material(seqs, spec.block_size, k, temps)
        spines = proposal.tokens.cpu().tolist()
        out = []
        for row, (temp, logp, ranked) in enumerate(zip(temps, logprobs.cpu(), ids.cpu())):
            if not temp:
                out.append((build_tree(logp[:, :k], ranked[:, :k], shape.tree_budget, spec.tree_rule), {}))
                continue
            tree = build_tree(*with_spine(logp, ranked, spines[row], k), shape.tree_budget, "spine-first")
            spine = min(len(spines[row]), shape.tree_budget)  # nodes 1..spine: the sampled chain
            out.append((tree, {n: d for n, d in proposal.drawn(row).items() if n <= spine}))
        return out

    def selector_trees(self, seqs: list[Sequence], shape: DraftShape) -> list[tuple[Tree, dict[int, Drawn]]]:
        """A DFlash2 draft's trees (selector_tree.py), grown around its greedy walk, or around a sampled
        row's walk under "rejection" (the walk's nodes are its sampled ones)."""
        spec = self.speculation
        temps = temperatures(seqs, spec.accept)
        scores, candidates, proposal = self.draft.selector_material(seqs, spec.block_size, temps)
        out = []
        for row, (row_scores, row_candidates) in enumerate(zip(scores.cpu(), candidates.cpu())):
            if not temps[row]:
                out.append((selector_tree(row_scores, row_candidates, spec.tree_topk, shape.tree_budget), {}))
                continue
            path = proposal.tokens[row].tolist()
            walked = [row_candidates[i].tolist().index(token) for i, token in enumerate(path)]
            tree = selector_tree(row_scores, row_candidates, spec.tree_topk, shape.tree_budget, walked)
            depth = min(len(walked), shape.tree_budget)
            out.append((tree, {n: d for n, d in proposal.drawn(row).items() if n <= depth}))
        return out


def accept_chain(seq: Sequence, host: torch.Tensor, target: torch.Tensor, rule: AcceptRule,
                 drawn: dict[int, Drawn]) -> Outcome:
    """A chain's accepted candidates (their places 1.. in the row), the bonus, and the logits that chose them
    (for a request that needs logits)."""
    accepted, bonus = accept(seq, host, target[: host.shape[0] + 1], rule, drawn)
    return list(range(1, accepted + 1)), bonus, target[: accepted + 1] if seq.needs_logits else None


def tally(seq: Sequence, source: str, committed: int, speculative: bool, tree: bool = False) -> None:
    """Count a committed step in the request's statistics; a plain step of a speculative request (one the
    governor chose) is not a verify step, so the draft's tau stays its own, and copies (alone or merged
    with the draft's candidates) are counted apart from it too. `tree`: the draft's candidates were a tree."""
    stats = seq.stats
    if source == "lookup":
        stats.lookup_accept_lengths.append(committed)
    elif source == "merged":
        stats.merged_accept_lengths.append(committed)
    elif source == "draft" or not speculative:
        stats.accept_lengths.append(committed)  # plain decoding: one verify step of one token
        if tree and source == "draft":
            stats.tree_steps += 1
    else:
        stats.plain_steps += 1
