"""Request fields beyond the sampling basics, each lossless under speculation: presence and frequency
penalties (applied position by position inside a verified block, exactly as plain decoding applies them),
log-probabilities from the target's own distribution, stop strings, and what proposed each token."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockspec.engine.sampler import filtered_probs, penalized
from blockspec.engine.sequence import Sequence
from blockspec.models.config import ModelConfig
from blockspec.models.loader import load_draft, load_target
from blockspec.sampling_params import SamplingParams
from blockspec.speculative.proposal import Proposal
from blockspec.train.features import causal_batch
from tests.test_dflash_lossless import max_z
from tests.tiny import ScriptedGovernor, TinyEngine, write_tiny_draft, write_tiny_target

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fields")
    write_tiny_target(folder / "target", "llama")
    cfg = ModelConfig.from_folder(folder / "target")
    write_tiny_draft(folder / "draft", cfg, block_size=8)
    target = load_target(folder / "target", torch.float32, CPU)
    draft = load_draft(folder / "draft", cfg, torch.float32, CPU)
    chain = TinyEngine(target, draft, 8, num_slots=4, max_len=160)
    tree = TinyEngine(target, draft, 4, num_slots=4, max_len=160, tree=(8, 3, "best-first"))
    return target, {"chain": chain, "tree": tree}


def run(engine, prompts, params, use_draft, lookup=(0, 0), script=None):
    engine.dflash.governor = None if script is None else ScriptedGovernor(script)
    engine.speculation.lookup_ngram, engine.speculation.lookup_width = lookup
    try:
        return engine.run([Sequence(p, params, frozenset()) for p in prompts], use_draft)
    finally:
        engine.dflash.governor, engine.speculation.lookup_ngram = None, 0


@torch.inference_mode()
def reference(target, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding the slow way: a full forward per token, penalties counted over the output so far."""
    out, raw = [], []
    for _ in range(params.max_tokens):
        hidden, _ = target(causal_batch(torch.tensor([prompt + out])))
        logits = target.logits(hidden[:, -1])
        raw.append(logits[0])
        out.append(int(penalized(logits, params, out, []).argmax()))
    return out, raw


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(presence=st.sampled_from([0.0, 0.5, 2.0, -1.0]), frequency=st.sampled_from([0.0, 0.7, 2.0, -0.5]),
       kind=st.sampled_from(["chain", "tree"]), lookup=st.sampled_from([(0, 0), (1, 6)]),
       script=st.one_of(st.none(), st.just([True, False, True])))
def test_greedy_penalties_equal_plain_decoding(tiny, presence, frequency, kind, lookup, script):
    target, engines = tiny
    prompts = [[5, 6, 7, 8] * 5, [3, 41, 17, 88, 2, 60]]
    params = SamplingParams(max_tokens=24, presence_penalty=presence, frequency_penalty=frequency,
                            ignore_eos=True)
    plain = run(engines[kind], prompts, params, use_draft=False)
    spec = run(engines[kind], prompts, params, use_draft=True, lookup=lookup, script=script)
    assert [s.output_ids for s in spec] == [p.output_ids for p in plain]
    assert sum(len(s.stats.accept_lengths) for s in spec) < sum(len(s.output_ids) for s in spec)  # it drafted
    assert plain[0].output_ids == reference(target, prompts[0], params)[0]


def test_penalties_change_the_output(tiny):
    target, engines = tiny
    prompt = [5, 6, 7, 8] * 5
    free = run(engines["chain"], [prompt], SamplingParams(max_tokens=30, ignore_eos=True), True)[0]
    held = run(engines["chain"], [prompt], SamplingParams(max_tokens=30, ignore_eos=True,
                                                          frequency_penalty=2.0), True)[0]
    assert free.output_ids != held.output_ids
    assert max(Counter(held.output_ids).values()) < max(Counter(free.output_ids).values())


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_logprobs_are_the_targets_own(tiny, kind):
    target, engines = tiny
    prompt = [3, 41, 17, 88, 2, 60]
    params = SamplingParams(max_tokens=20, logprobs=3, ignore_eos=True)
    plain = run(engines[kind], [prompt], SamplingParams(max_tokens=20, ignore_eos=True), False)[0]
    spec = run(engines[kind], [prompt], params, True)[0]
    assert spec.output_ids == plain.output_ids  # asking for logprobs changes no token
    assert len(spec.logprobs) == len(spec.output_ids)
    _, raw = reference(target, prompt, SamplingParams(max_tokens=20))
    for entry, token, logits in zip(spec.logprobs, spec.output_ids, raw):
        exact = torch.log_softmax(logits.float(), -1)
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(exact[token]), abs=1e-4)
        assert [t for t, _ in entry.top] == exact.topk(3).indices.tolist()
        assert entry.top[0][1] == pytest.approx(float(exact.max()), abs=1e-4)


def test_token_sources_follow_the_steps(tiny):
    _, engines = tiny
    seq = run(engines["chain"], [[5, 6, 7, 8] * 5], SamplingParams(max_tokens=40), True, lookup=(1, 6))[0]
    sources = Counter(source for source, _ in seq.token_sources)
    assert len(seq.token_sources) == len(seq.output_ids) and set(sources) <= {"draft", "lookup", "target"}
    stats = seq.stats
    assert sources["lookup"] + sources["draft"] + sources["target"] == len(seq.output_ids)
    assert sources["target"] >= len(stats.accept_lengths) + len(stats.lookup_accept_lengths)
    plain = run(engines["chain"], [[5, 6, 7, 8] * 5], SamplingParams(max_tokens=40), False)[0]
    assert plain.token_sources == [("target", step) for step in range(len(plain.output_ids))]


def exact_penalized(target, prompt, params, prefix: list[int]) -> torch.Tensor:
    hidden, _ = target(causal_batch(torch.tensor([prompt + prefix])))
    return filtered_probs(penalized(target.logits(hidden[:, -1]), params, prefix, []), params)[0]


def oracle_proposer(target, prompt: list[int], params: SamplingParams):
    """Draft stand-ins that propose the penalized target's most likely continuation (the tree's others ranked
    after it), so that drafted positions, whose penalties count the candidates before them, are judged
    often: a rule that ignored those candidates would show."""
    best: dict[tuple[int, ...], int] = {}

    def chain(seq, length: int) -> list[int]:
        prefix, out = tuple(seq.output_ids), []
        for _ in range(length):
            if prefix not in best:
                best[prefix] = int(exact_penalized(target, prompt, params, list(prefix)).argmax())
            out.append(best[prefix])
            prefix += (out[-1],)
        return out

    def propose(seqs, block_size, rule="match"):
        return Proposal(torch.tensor([chain(seq, block_size - 1) for seq in seqs]))

    def rank(seqs, block_size, k):
        first = propose(seqs, block_size).tokens
        ids = torch.stack([(first + i) % 16 for i in range(k)], dim=-1)
        logprobs = torch.tensor([-0.1 - 2.0 * i for i in range(k)]).expand_as(ids).clone()
        return logprobs, ids

    return propose, rank


def lumped_z(counts: Counter, probs: dict, n: int) -> float:
    """`max_z`, with the cells expected to hold < 20 samples merged into one (a bias that moves mass into
    rare tokens shows there)."""
    rare = {t for t, p in probs.items() if n * p < 20}
    merged_probs = {t: p for t, p in probs.items() if t not in rare} | {"rare": sum(probs[t] for t in rare)}
    merged = Counter({t: c for t, c in counts.items() if t not in rare})
    merged["rare"] = sum(c for t, c in counts.items() if t in rare)
    return max_z(merged, merged_probs, n)


def worst_penalized_deviation(tmp_path, tree) -> float:
    """Tokens 2 and 3 (drafted positions, each penalized by the tokens before it) against the exact
    penalized distribution, over 8000 samples: the largest standardised deviation."""
    write_tiny_target(tmp_path / "t", "llama", vocab_size=16, seed=3)
    cfg = ModelConfig.from_folder(tmp_path / "t")
    write_tiny_draft(tmp_path / "d", cfg, block_size=4, mask_token_id=15)
    target = load_target(tmp_path / "t", torch.float32, CPU)
    draft = load_draft(tmp_path / "d", cfg, torch.float32, CPU)
    engine = TinyEngine(target, draft, 4, num_slots=64, max_len=32, tree=tree)
    prompt, n = [3, 1], 8000
    sp = dict(temperature=1.0, presence_penalty=2.0, frequency_penalty=1.0, ignore_eos=True)
    params = SamplingParams(max_tokens=3, **sp)
    engine.dflash.draft.propose, engine.dflash.draft.rank = oracle_proposer(target, prompt, params)
    seqs = [Sequence(prompt, SamplingParams(max_tokens=3, seed=i, **sp), frozenset()) for i in range(n)]
    engine.run(seqs, use_draft=True)
    assert sum(len(s.stats.accept_lengths) for s in seqs) < 1.9 * n  # drafted tokens were often kept
    outputs = [tuple(s.output_ids) for s in seqs]
    first = Counter(o[0] for o in outputs).most_common(1)[0][0]  # condition on the first token
    after = [o[1:] for o in outputs if o[0] == first]
    second = exact_penalized(target, prompt, params, [first])
    worst = lumped_z(Counter(o[0] for o in after), {t: float(second[t]) for t in range(16)}, len(after))
    for t2 in [t for t in range(16) if second[t] > 0.15]:
        third = exact_penalized(target, prompt, params, [first, t2])
        rows = [o[1] for o in after if o[0] == t2]
        worst = max(worst, lumped_z(Counter(rows), {t: float(third[t]) for t in range(16)}, len(rows)))
    return worst


@pytest.mark.parametrize("tree", [(0, 4, "best-first"), (6, 3, "best-first")])
@torch.inference_mode()
def test_sampled_penalties_keep_the_penalized_target_distribution(tmp_path, tree):
    assert worst_penalized_deviation(tmp_path, tree) < 5.0


@torch.inference_mode()
def test_the_check_catches_penalties_that_ignore_the_block(tmp_path, monkeypatch):
    """Negative control: penalising every row of a block by the output alone (not the candidates before
    it) must fail the same check."""
    import blockspec.speculative.accept as accept_module

    def blind(logits, params, output_ids, candidates):
        return torch.cat([penalized(logits[i : i + 1], params, output_ids, []) for i in range(len(logits))])

    monkeypatch.setattr(accept_module, "penalized", blind)
    assert worst_penalized_deviation(tmp_path, (0, 4, "best-first")) > 5.0
