"""The sampled acceptance rule as a choice: "match" and "rejection" (speculative/rejection.py).

The exact-distribution checks run the decoder's own proposal and acceptance code (DFlashProposer, the
chain, tree and merged-tree paths) over a table model: the target's next-token logits and the draft's
block scores are fixed random tables over 6 tokens, so thousands of seeded decodes take seconds and the
target's joint distribution of the first tokens is known exactly. Negative controls (a residual that is p,
not norm(max(0, p - q)); a q that is not what was sampled from) must fail the same check. Note that
treating a sampled token's q as one-hot is NOT a control: a one-hot test is exact for any token (it only
keeps fewer).
"""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import blockspec.speculative.accept as accept_module
import blockspec.speculative.rejection as rejection_module
from blockspec.config import EngineConfig
from blockspec.engine.sampler import RESIDUAL, draw, filtered_probs, penalized
from blockspec.engine.sequence import Sequence
from blockspec.errors import BlockspecError, cli_flags
from blockspec.layers.selector import walk
from blockspec.sampling_params import SamplingParams
from blockspec.speculative.accept import accept_trees
from blockspec.speculative.decoder import Decoder, accept_chain
from blockspec.speculative.dflash import DFlashProposer
from blockspec.speculative.plan import DraftShape, Speculation, StepPlan
from blockspec.speculative.proposal import Proposal
from tests.test_dflash_lossless import max_z, worst_deviation

V, PENDING, N = 6, 2, 4000
_gen = torch.Generator().manual_seed(11)
TARGET = torch.randn(V, V, generator=_gen) * 1.5  # next-token logits given the last token
DRAFT = torch.randn(V, 8, V, generator=_gen) * 1.5  # the draft's block scores per position, given the pending
EDGE = torch.randn(V, V, generator=torch.Generator().manual_seed(12)) * 1.5  # a selector's edge term [p, c]
K2 = 4  # a selector's candidates per position (fewer than V: the residual must cover the others)


@pytest.fixture(autouse=True)
def _one_thread():
    """Thousands of tiny tensor ops: one thread (OpenMP workers only wait on each other here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TableRunner:
    """What DFlashProposer asks of a runner, from the DRAFT table."""

    device = torch.device("cpu")
    draft = SimpleNamespace(vocab=None, config=SimpleNamespace(dflash2=None))
    target = SimpleNamespace(config=SimpleNamespace(vocab_size=V))

    def draft_ranking(self, seqs, block, k):
        scores = DRAFT[block[:, 0], : block.shape[1] - 1].log_softmax(dim=-1)
        return scores.topk(k, dim=-1)

    def draft_proposals(self, seqs, block):
        return DRAFT[block[:, 0], : block.shape[1] - 1].argmax(dim=-1)


class SelectorRunner(TableRunner):
    """A DFlash2 draft's lattice from the tables: position i's K2 best tokens by DRAFT, each edge scored
    DRAFT + EDGE[predecessor, candidate] (the anchor before position 0); the walk is the engine's."""

    draft = SimpleNamespace(vocab=None, config=SimpleNamespace(dflash2=True))

    def draft_lattice(self, seqs, block):
        unary, candidates = DRAFT[block[:, 0], : block.shape[1] - 1].topk(K2, dim=-1)  # [b, γ, K2]
        anchor = block[:, :1, None].expand(-1, 1, K2)
        predecessors = torch.cat([anchor, candidates[:, :-1]], dim=1)
        return unary.unsqueeze(2) + EDGE[predecessors.unsqueeze(-1), candidates.unsqueeze(2)], candidates

    def draft_walk(self, seqs, block, temperatures=None, uniforms=None):
        return walk(*self.draft_lattice(seqs, block), temperatures, uniforms)

    def draft_proposals(self, seqs, block):
        return self.draft_walk(seqs, block).tokens


def table_decoder(accept: str, block_size: int, tree: int = 0, copy: int = 0,
                  selector: bool = False) -> Decoder:
    decoder = Decoder.__new__(Decoder)
    decoder.speculation = Speculation(block_size, 0, lookup_ngram=1 if copy else 0, lookup_width=copy + 1,
                                      tree_budget=tree, tree_topk=3, merge="always", accept=accept)
    decoder.runner = SelectorRunner() if selector else TableRunner()
    decoder.draft = DFlashProposer(decoder.runner, 0)
    return decoder


def target(seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
    """The target's outputs as the runner gives them: logits, or greedy ids for a request without them."""
    return logits if seq.needs_logits else logits.argmax(dim=-1)


def step(decoder: Decoder, seq: Sequence, tree: int, copy: int) -> list[int]:
    """One decode step of `seq` through the decoder's propose and accept: the committed tokens."""
    spec = decoder.speculation
    shape = DraftShape(spec.block_size, tree)
    last = seq.pending_token
    plan = (StepPlan.merged([[(last + 1 + i) % V for i in range(copy)]], spec, shape) if copy
            else StepPlan.dflash(1, shape))
    candidates, trees, _, drawn = decoder.propose([seq], plan)
    host = candidates.cpu()
    if trees is None:
        context = torch.tensor([last] + host[0].tolist())
        path, bonus, _ = accept_chain(seq, host[0], target(seq, TARGET[context]), spec.accept, drawn[0])
        return [int(host[0, node - 1]) for node in path] + [bonus]

    def outputs(wanted):
        return [target(seq, TARGET[(trees[row].path_tokens(node) or [last])[-1]]) for row, node in wanted]

    path, bonus, _ = accept_trees([seq], trees, outputs, spec.accept, drawn)[0]
    return [trees[0].tokens[node - 1] for node in path] + [bonus]


def decode(decoder: Decoder, params: dict, seed: int, tokens: int, tree: int = 0, copy: int = 0) -> tuple:
    seq = Sequence([0, 1], SamplingParams(seed=seed, max_tokens=64, **params), frozenset())
    seq.output_ids.append(PENDING)
    while len(seq.output_ids) <= tokens:
        seq.output_ids.extend(step(decoder, seq, tree, copy))
    return tuple(seq.output_ids[1 : tokens + 1])


def exact_joint(params: dict, tokens: int) -> dict[tuple, float]:
    """The target's distribution of the first `tokens` tokens after PENDING (penalties count the output)."""
    sp = SamplingParams(**params)
    joint = {(): 1.0}
    for _ in range(tokens):
        grown = {}
        for prefix, p in joint.items():
            history = [PENDING, *prefix]
            row = filtered_probs(penalized(TARGET[history[-1]].unsqueeze(0), sp, history, []), sp)[0]
            grown.update({(*prefix, t): p * float(row[t]) for t in range(V) if row[t] > 0})
        joint = grown
    return joint


def deviation(accept: str, block_size: int, params: dict, tree: int = 0, copy: int = 0, tokens: int = 2,
              n: int = N, selector: bool = False) -> float:
    decoder = table_decoder(accept, block_size, tree, copy, selector)
    counts = Counter(decode(decoder, params, seed, tokens, tree, copy) for seed in range(n))
    return max_z(counts, exact_joint(params, tokens), n)


T1 = dict(temperature=1.0)
FILTERED = dict(temperature=0.7, top_k=4, top_p=0.9, presence_penalty=0.5)


@pytest.mark.parametrize("block_size, params", [(2, T1), (4, T1), (6, FILTERED), (4, dict(temperature=0.5))])
def test_rejection_chain_has_the_target_distribution(block_size, params):
    assert deviation("rejection", block_size, params, tokens=3 if block_size == 2 else 2) < 5.0


@pytest.mark.parametrize("tree, copy, params", [(5, 0, T1), (7, 0, FILTERED), (0, 2, T1), (5, 2, T1)])
def test_rejection_trees_and_merged_trees_have_the_target_distribution(tree, copy, params):
    """Trees spined on the sampled chain, a copy merged into the chain, a copy merged into a tree."""
    assert deviation("rejection", 4, params, tree=tree, copy=copy) < 5.0


@pytest.mark.parametrize("block_size, tree, copy, params", [(2, 0, 0, T1), (5, 0, 0, FILTERED), (4, 5, 0, T1),
                                                            (4, 7, 0, FILTERED), (4, 5, 2, T1)])
def test_rejection_with_a_selector_walk_has_the_target_distribution(block_size, tree, copy, params):
    """A DFlash2 draft: q is each step's selector distribution given the token drawn before it; trees grow
    around the sampled walk (selector_tree.py)."""
    assert deviation("rejection", block_size, params, tree=tree, copy=copy, selector=True) < 5.0


def test_match_keeps_the_target_distribution_on_the_same_harness():
    assert deviation("match", 4, T1, tree=5, copy=2) < 5.0


def residual_is_p(p, stages, seed, position):
    """The classic bug: min(1, p/q) tests, but a rejection redrawn from p itself."""
    r = p.double()
    for index, (token, dist) in enumerate(stages):
        q = rejection_module.stage_q(r, token, dist)
        if rejection_module.uniform(seed, position, rejection_module.ACCEPT, index) * q[token] < r[token]:
            return index, token
    return None, draw(r.unsqueeze(0), seed, position, RESIDUAL)[0]


@pytest.mark.parametrize("tree, copy, selector", [(0, 0, False), (5, 0, False), (0, 2, False), (0, 0, True),
                                                 (5, 0, True)])
def test_negative_control_residual_equal_to_p_fails(monkeypatch, tree, copy, selector):
    monkeypatch.setattr(rejection_module, "judge", residual_is_p)
    monkeypatch.setattr(accept_module, "judge", residual_is_p)
    assert deviation("rejection", 4, T1, tree=tree, copy=copy, selector=selector) > 5.0


@pytest.mark.parametrize("selector", [False, True])
def test_negative_control_a_q_other_than_the_sampled_one_fails(monkeypatch, selector):
    """The verifier told a sharper q than the one the tokens were drawn from."""
    real = Proposal.drawn

    def sharpened(self, row):
        return {node: (ids, q**3 / (q**3).sum()) for node, (ids, q) in real(self, row).items()}

    monkeypatch.setattr(Proposal, "drawn", sharpened)
    assert deviation("rejection", 4, T1, selector=selector) > 5.0


def test_rejection_keeps_more_where_the_draft_is_its_own_target():
    """Where q = p the rule keeps every sampled token; "match" keeps a token with probability p(d) only."""
    global TARGET
    saved = TARGET
    TARGET = DRAFT[:, 0].clone()  # the target's next-token logits = the draft's position-0 scores
    try:
        def first_kept(accept):
            decoder = table_decoder(accept, 2)
            kept = 0
            for seed in range(300):
                seq = Sequence([0, 1], SamplingParams(seed=seed, max_tokens=64, temperature=1.0), frozenset())
                seq.output_ids.append(PENDING)
                kept += len(step(decoder, seq, 0, 0)) - 1
            return kept / 300
        assert first_kept("rejection") == 1.0
        assert first_kept("match") < 0.8
    finally:
        TARGET = saved


def test_greedy_requests_are_unchanged_under_rejection():
    decoder = table_decoder("rejection", 4)
    argmax = table_decoder("match", 4)
    for seed in range(5):
        greedy = dict(temperature=0.0)
        assert decode(decoder, greedy, seed, 8) == decode(argmax, greedy, seed, 8)


# ---- end to end on the tiny target (as tests/test_dflash_lossless.py builds it) ---------------------------
@pytest.mark.parametrize("kwargs", [dict(params=dict(temperature=1.0)),
                                    dict(params=dict(temperature=0.8, top_k=5), tree=(6, 3, "best-first")),
                                    dict(params=dict(temperature=1.0), lookup_ngram=1, merge="always"),
                                    dict(params=dict(temperature=1.0), lookup_ngram=1, merge="never"),
                                    dict(params=dict(temperature=1.0), dflash2=True),
                                    dict(params=dict(temperature=0.8), tree=(6, 3, "best-first"),
                                         dflash2=True)])
def test_sampled_rejection_matches_plain_sampling_on_a_tiny_target(tmp_path, kwargs):
    """The first three tokens of 8000 seeded requests against the target's exact distribution (which plain
    sampled decoding draws from)."""
    assert worst_deviation(tmp_path, accept="rejection", **kwargs) < 5.0


def test_bad_rule_is_refused_by_name():
    with pytest.raises(BlockspecError, match="^speculative_accept='accept-all' must be one of match, rejec"):
        EngineConfig(speculative_accept="accept-all")
    with pytest.raises(BlockspecError, match="^--speculative-accept="), \
            cli_flags({"speculative_accept": "--speculative-accept"}):
        EngineConfig(speculative_accept="accept-all")
