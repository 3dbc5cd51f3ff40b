"""DFlash2 drafts: the convolution, the candidates, the lattice and the walk against straightforward loops of
their formulas; identity convolutions reproduce the DFlash draft; the z-lab checkpoint format loaded and
written back; every config mistake named; greedy (and seeded sampled) decoding equal to plain decoding."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors.torch import save_file

from blockspec.layers.conv import DynamicConv
from blockspec.layers.embedding import LMHead
from blockspec.layers.forward_batch import ForwardBatch
from blockspec.layers.kv_cache import KVCache
from blockspec.layers.selector import CandidateSelector, walk
from blockspec.models.config import ModelConfig
from blockspec.models.dflash2 import dflash2_from, lattice, unary_candidates
from blockspec.models.dflash2_config import Dflash2Config
from blockspec.models.loader import load_draft, save_draft
from blockspec.sampling_params import SamplingParams
from tests.draft_mistakes import DFLASH2, Mistake, edit
from tests.tiny import TinyEngine, tiny_target_with_draft

CPU = torch.device("cpu")
D2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- golden: loops of the formulas


def conv_loop(x, base, delta, offsets, group):
    """out[i, c] = sum_t [i - t in i's block] (base[t, c] + delta[i, t, c // group]) * x[i - t, c]."""
    b, n, h = x.shape
    out = torch.zeros(b, n, h, dtype=torch.float64)
    for r in range(b):
        for i in range(n):
            for t in range(base.shape[0]):
                if offsets[r if offsets.shape[0] > 1 else 0, i] < t:
                    continue
                for c in range(h):
                    out[r, i, c] += (base[t, c] + delta[r, i, t, c // group]) * x[r, i - t, c]
    return out


@pytest.mark.parametrize("kernel,group", [(2, 16), (3, 8)])
def test_convolution_equals_its_formula(kernel, group):
    h, b, block, count = 32, 2, 4, 3
    conv = DynamicConv(h, kernel, group)
    with torch.no_grad():
        conv.base_kernel.copy_(torch.randn(2, kernel, h, generator=gen(0)))
        conv.kernel_projection.weight.copy_(torch.randn(2 * kernel * (h // group), h, generator=gen(1)) * .3)
    x = torch.randn(b, block * count, h, generator=gen(2))
    # training's layout: many blocks per row, each seeing only itself
    own = torch.arange(block * count) // block
    blocks = (own[:, None] == own[None]).unsqueeze(0)
    batch = ForwardBatch.standalone(None, torch.zeros(b, block * count), blocks)
    offsets = batch.block_offsets()
    assert offsets.tolist() == [list(range(block)) * count]
    y, kernel_out = conv.prepare(x, offsets)
    delta = (x.double() @ conv.kernel_projection.weight.double().T).view(b, -1, 2, kernel, h // group)
    base = conv.base_kernel.double()
    want = conv_loop(x.double(), base[0], delta[:, :, 0], offsets, group)
    assert torch.allclose(y.double(), want, atol=1e-5)
    z = torch.randn(b, block * count, h, generator=gen(3))
    out = conv.finish(z, kernel_out, offsets)
    assert torch.allclose(out.double(), conv_loop(z.double(), base[1], delta[:, :, 1], offsets, group),
                          atol=1e-5)
    # inference's layout: one block per row, positions anywhere (offsets from the block itself)
    one = ForwardBatch.standalone(None, torch.arange(5, 5 + block).expand(b, -1), "all")
    assert one.block_offsets().tolist() == [list(range(block))]


def walk_loop(unary, cand, proj, a_book, b_book, anchor, temps, uniforms):
    """Per row, step by step: S(p, c) = u[c] + sum_r A[p, r] P[r] B[c, r]; argmax, or the first candidate
    whose cumulative softmax(S / T) exceeds u * total."""
    b, steps, k = cand.shape
    tokens, qs = torch.zeros(b, steps, dtype=torch.long), torch.zeros(b, steps, k, dtype=torch.float64)
    for r in range(b):
        prev = int(anchor[r])
        for i in range(steps):
            s = [float(unary[r, i, c]) + sum(float(a_book[prev, j] * proj[r, i, j] * b_book[cand[r, i, c], j])
                                             for j in range(proj.shape[-1])) for c in range(k)]
            if temps[r] == 0:
                pick = max(range(k), key=lambda c: (s[c], -c))
                qs[r, i, pick] = 1.0
            else:
                top = max(s)
                e = [math.exp((v - top) / float(temps[r])) for v in s]
                q = [v / sum(e) for v in e]
                acc, pick = 0.0, k - 1
                for c in range(k):
                    acc += q[c]
                    if acc > float(uniforms[r, i]) * sum(q):
                        pick = c
                        break
                qs[r, i] = torch.tensor(q, dtype=torch.float64)
            tokens[r, i] = prev = int(cand[r, i, pick])
    return tokens, qs


@torch.no_grad()
def test_candidates_lattice_and_walk_equal_their_formulas():
    h, vocab, rank, k, b, steps = 32, 50, 8, 6, 4, 5
    head = LMHead(h, vocab)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, h, generator=gen(0)))
    d2 = Dflash2Config(2, 16, rank, k, vocab, output_multiplier=0.6, final_logit_softcapping=3.0)
    hidden = torch.randn(b, steps, h, generator=gen(1))
    unary, cand = unary_candidates(head, hidden, d2)
    logits = hidden.double() @ head.weight.detach().double().T
    for r in range(b):
        for i in range(steps):
            order = sorted(range(vocab), key=lambda v: -float(logits[r, i, v]))[:k]
            assert cand[r, i].tolist() == order
            want = [math.tanh(0.6 * float(logits[r, i, v]) / 3.0) * 3.0 for v in order]
            assert torch.allclose(unary[r, i].double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)
    subset = torch.tensor([1, 4, 5, 9, 17, 23, 30, 31, 44, 49])  # a draft's sorted vocabulary
    sub_unary, sub_cand = unary_candidates(head, hidden, d2, subset)
    for r in range(b):
        for i in range(steps):
            order = sorted(subset.tolist(), key=lambda v: -float(logits[r, i, v]))[:k]
            assert sub_cand[r, i].tolist() == order
            want = [math.tanh(0.6 * float(logits[r, i, v]) / 3.0) * 3.0 for v in order]
            want = torch.tensor(want, dtype=torch.float64)
            assert torch.allclose(sub_unary[r, i].double(), want, atol=1e-5)
    selector = CandidateSelector(h, rank, vocab)
    selector.init_random(gen(2), std=0.7)
    anchor = torch.randint(0, vocab, (b,), generator=gen(3))
    scores = selector.lattice(hidden, unary, cand, anchor)
    assert scores.shape == (b, steps, k, k) and scores.dtype == torch.float32
    proj = hidden.double() @ selector.hidden_projection.weight.detach().double().T
    temps = torch.tensor([0.0, 0.7, 1.0, 2.5])
    uniforms = torch.rand(b, steps, generator=gen(4), dtype=torch.float64)
    got = walk(scores, cand, temps, uniforms)
    tokens, q = walk_loop(unary, cand, proj, selector.predecessor_codebook.detach().double(),
                          selector.successor_codebook.detach().double(), anchor, temps, uniforms)
    assert torch.equal(got.tokens, tokens) and torch.equal(got.candidates, cand)
    assert got.q.dtype == torch.float32 and torch.allclose(got.q.double(), q, atol=1e-5)
    greedy = walk(scores, cand)  # no temperatures: every row greedy
    assert torch.equal(greedy.tokens[0], tokens[0]) and bool((greedy.q.sum(-1) == 1).all())
    with pytest.raises(ValueError, match="need uniforms"):
        walk(scores, cand, temps)


# ---------------------------------------------------------------- the draft


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama target (fp32), its random DFlash draft (dense) and a DFlash2 draft made from it."""
    folder = tmp_path_factory.mktemp("dflash2")
    target, cfg, draft_folder = tiny_target_with_draft(folder, "llama", CPU, draft_block_size=8)
    v1 = load_draft(draft_folder, cfg, torch.float32, CPU)
    v1.use_target_embedding(target.embed_tokens)
    return target, cfg, v1, folder


def d2_for(cfg: ModelConfig, **kw) -> Dflash2Config:
    return Dflash2Config(**D2, vocab_size=cfg.vocab_size, **kw)


def test_identity_convolutions_reproduce_the_dflash_draft(tiny):
    target, cfg, v1, _ = tiny
    v2 = dflash2_from(v1, d2_for(cfg), gen(0))
    b, block, count, ctx = 2, 4, 3, 20
    features = torch.randn(b, ctx, 2 * cfg.hidden_size, generator=gen(1))
    ids = torch.randint(0, cfg.vocab_size, (b, block * count), generator=gen(2))
    own = torch.arange(block * count) // block
    batch = lambda: ForwardBatch.standalone(  # noqa: E731 - training's layout: many blocks per row
        ids, torch.arange(block * count).expand(b, -1) + 7, (own[:, None] == own[None]).unsqueeze(0),
        torch.arange(ctx).expand(b, -1), torch.ones(b, block * count, ctx, dtype=torch.bool))
    with torch.no_grad():
        assert torch.equal(v2(batch(), features), v1(batch(), features))
    # in a cache (inference): the same context injected, one block per row
    outs = []
    for draft in (v1, v2):
        cache = KVCache.for_model(draft, 2, 64)
        with torch.inference_mode():
            draft.inject(features, ForwardBatch.in_cache(cache, [0, 1], [0, 0], num_new=ctx))
            block_batch = ForwardBatch.in_cache(cache, [0, 1], [ctx, ctx], ids[:, :block], among_new="all")
            outs.append(draft(block_batch))
    assert torch.equal(outs[0], outs[1])


def write_checkpoint(folder, cfg: ModelConfig, v1_folder, seed: int = 0, **extra_d2) -> None:
    """A DFlash2 checkpoint written tensor by tensor (safetensors), as z-lab's exporter lays it out."""
    from safetensors import safe_open

    with safe_open(str(v1_folder / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    raw = json.loads((v1_folder / "config.json").read_text())
    h, g = cfg.hidden_size, cfg.hidden_size // D2["conv_group_size"]
    rng = gen(seed)
    for i in range(raw["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            tensors[f"layers.{i}.{conv}.base_kernel"] = torch.randn(2, 2, h, generator=rng) * 0.5
            projection = torch.randn(4 * g, h, generator=rng) * 0.1
            tensors[f"layers.{i}.{conv}.kernel_projection.weight"] = projection
    for name in ("predecessor_codebook", "successor_codebook"):
        tensors[f"candidate_selector.{name}"] = torch.randn(cfg.vocab_size, 16, generator=rng) * 0.5
    tensors["candidate_selector.hidden_projection.weight"] = torch.randn(16, h, generator=rng) * 0.5
    raw["architectures"] = ["DFlash2DraftModel"]
    raw["dflash_config"].update(D2, output_multiplier=0.8, final_logit_softcapping=6.0, **extra_d2)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))


def test_a_dflash2_checkpoint_loads_and_saves_back_in_its_format(tiny, tmp_path):
    target, cfg, v1, folder = tiny
    write_checkpoint(tmp_path / "zlab", cfg, folder / "draft", input_embedding_scale=1.25)
    draft = load_draft(tmp_path / "zlab", cfg, torch.float32, CPU)
    d2 = draft.config.dflash2
    got = (d2.selector_top_k, d2.output_multiplier, d2.final_logit_softcapping, d2.input_embedding_scale)
    assert got == (8, 0.8, 6.0, 1.25)
    save_draft(draft, tmp_path / "back")
    raw = json.loads((tmp_path / "back" / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"] and raw["vocab_size"] == cfg.vocab_size
    assert {k: raw["dflash_config"][k] for k in D2} == D2
    assert raw["dflash_config"]["input_embedding_scale"] == 1.25
    from safetensors import safe_open

    with safe_open(str(tmp_path / "back" / "model.safetensors"), "pt") as f, \
            safe_open(str(tmp_path / "zlab" / "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())  # codebooks bare, no `.weight`
        assert all(torch.equal(f.get_tensor(n), g.get_tensor(n)) for n in f.keys())
    again = load_draft(tmp_path / "back", cfg, torch.float32, CPU)
    assert again.config == draft.config
    mine, theirs = again.state_dict(), draft.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    # the embedding scale reaches the whole block, anchor included
    draft.use_target_embedding(target.embed_tokens)
    ids = torch.tensor([[9, 5, 5]])
    assert torch.equal(draft.embed(ids), target.embed_tokens(ids) * 1.25)


def test_greedy_and_sampled_walks_from_the_runner(tiny, tmp_path):
    """runner.draft_walk: greedy rows walk the lattice's argmax; sampled rows draw by their uniforms, q
    being the softmax of the chosen row over the candidates; draft_proposals is the greedy walk."""
    target, cfg, _, folder = tiny
    write_checkpoint(tmp_path / "d2", cfg, folder / "draft")
    draft = load_draft(tmp_path / "d2", cfg, torch.float32, CPU)
    engine = TinyEngine(target, draft, 5, num_slots=2, max_len=64)
    from blockspec.engine.sequence import Sequence

    seqs = [Sequence(list(range(10, 20)), SamplingParams(max_tokens=8), frozenset()),
            Sequence(list(range(30, 36)), SamplingParams(max_tokens=8), frozenset())]
    for seq in seqs:
        engine.runner.admit(seq)
    hidden = engine.runner.prefill(seqs, [s.prompt_ids for s in seqs], capture=True)
    engine.runner.first_tokens(seqs, hidden)
    block = engine.dflash.draft.block(seqs, 5)
    with torch.inference_mode():
        greedy = engine.runner.draft_walk(seqs, block)
        assert torch.equal(engine.runner.draft_proposals(seqs, block), greedy.tokens)
        u = torch.rand(2, 4, generator=gen(5), dtype=torch.float64)
        mixed = engine.runner.draft_walk(seqs, block, torch.tensor([0.0, 0.9]), u)
        hid = engine.runner.draft_hidden(seqs, block)
        again = walk(*lattice(draft, target.lm_head, hid, block[:, 0]), torch.tensor([0.0, 0.9]), u)
    assert torch.equal(mixed.tokens[0], greedy.tokens[0]) and torch.equal(mixed.tokens, again.tokens)
    assert torch.allclose(mixed.q.sum(-1), torch.ones(2, 4)) and bool((mixed.q[0].max(-1).values == 1).all())


# ---------------------------------------------------------------- every mistake named, before any weight


@pytest.mark.parametrize("mistake", DFLASH2, ids=lambda m: m.what)
def test_every_config_mistake_is_named_before_a_weight_is_read(tiny, tmp_path, monkeypatch, mistake):
    from blockspec.errors import DraftConfigError
    from blockspec.models import loader

    _, cfg, _, folder = tiny
    write_checkpoint(tmp_path / "d2", cfg, folder / "draft")
    edit(tmp_path / "d2", mistake)
    monkeypatch.setattr(loader, "load_into", lambda *a: pytest.fail("a weight was read"))
    with pytest.raises(DraftConfigError, match=re.escape(mistake.says)):
        load_draft(tmp_path / "d2", cfg, torch.float32, CPU)


def test_a_dflash2_mistake_exits_2_through_the_command_line(tiny, tmp_path, capsys):
    from blockspec.cli import main
    from tests.tiny import write_tiny_tokenizer

    _, cfg, _, folder = tiny
    write_tiny_tokenizer(folder / "target")
    write_checkpoint(tmp_path / "d2", cfg, folder / "draft")
    edit(tmp_path / "d2", Mistake("", "", {"conv_group_size": 24}))
    code = main(["generate", "--model-path", str(folder / "target"), "--draft-model-path",
                 str(tmp_path / "d2"), "--max-new-tokens", "2", "ab"])
    err = capsys.readouterr().err
    assert code == 2 and "conv_group_size=24 does not divide hidden_size=64" in err and "Traceback" not in err


# ---------------------------------------------------------------- lossless end to end


@pytest.fixture(scope="module", params=["llama", "qwen3", "llama-q4_1"])
def engines(request, tmp_path_factory):
    """Per tiny target: a DFlash2 draft (random convolutions and selector) in fp32 and held as q8_0 blocks."""
    folder = tmp_path_factory.mktemp(request.param)
    target, cfg, draft_folder = tiny_target_with_draft(folder, request.param, CPU, draft_block_size=8)
    write_checkpoint(folder / "d2", cfg, draft_folder)
    out = {}
    for form in (None, "q8_0"):
        draft = load_draft(folder / "d2", cfg, torch.float32, CPU, quantization=form)
        out[form] = TinyEngine(target, draft, 8, num_slots=3, max_len=160)
    return out


def plain_and_dflash(engine, sizes):
    """(block size, plain, DFlash) per prompt, block size and request (greedy, seeded sampled)."""
    from blockspec.engine.sequence import Sequence

    prompts = [list(range(10, 40)), [7, 8, 9], list(range(60, 90, 2))]
    for size in sizes:
        engine.set_block_size(size)
        for params in (SamplingParams(max_tokens=40), SamplingParams(max_tokens=30, temperature=0.8, seed=3)):
            plain = engine.run([Sequence(p, params, frozenset()) for p in prompts], use_draft=False)
            spec = engine.run([Sequence(p, params, frozenset()) for p in prompts], use_draft=True)
            yield from ((size, p, s) for p, s in zip(plain, spec))


@pytest.mark.parametrize("form", [None, "q8_0"])
def test_greedy_and_seeded_sampled_dflash2_equal_plain_decoding(engines, form):
    engine = engines[form]
    draft = engine.runner.draft
    assert (draft.block_stack() is None) and (draft.context_stack() is not None) == (form is not None)
    for size, p, s in plain_and_dflash(engine, (2, 3, 5, 8)):
        assert s.output_ids == p.output_ids
        assert all(1 <= a <= size for a in s.stats.accept_lengths) and s.stats.accept_lengths


@pytest.fixture(scope="module")
def smollm2_dflash2(smollm2_dir, tmp_path_factory):
    """A DFlash2 draft for the embedded SmolLM2 made from the shipped DFlash draft (identity convolutions,
    a random selector large enough to change some paths; its candidates among the draft's vocabulary)."""
    from blockspec.paths import SHIPPED_DRAFT as DEFAULT_DRAFT
    from blockspec.models.tokenizer import Tokenizer

    cfg = ModelConfig.from_folder(smollm2_dir)
    v1 = load_draft(DEFAULT_DRAFT, cfg, torch.float32, CPU, Tokenizer.from_folder(smollm2_dir).token_to_id)
    assert v1.vocab is not None
    d2 = Dflash2Config(2, 16, 64, 16, cfg.vocab_size, final_logit_softcapping=30.0)
    folder = tmp_path_factory.mktemp("smollm2-dflash2")
    save_draft(dflash2_from(v1, d2, gen(0), std=0.3), folder)
    return folder


@pytest.mark.parametrize("form", ["none", "q8_0"])
def test_greedy_dflash2_on_smollm2_equals_plain_decoding(smollm2_dflash2, form):
    from blockspec import LLM

    llm = LLM(draft_model_path=str(smollm2_dflash2), draft_quantization=form, max_num_seqs=2,
              max_model_len=512, adaptive_speculation=False, prompt_lookup_ngram=0, block_size=8)
    assert llm.draft.config.dflash2 is not None and (llm.draft.fc.quant is not None) == (form == "q8_0")
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about rain."}]),
               "def fibonacci(n):"]
    params = SamplingParams(max_tokens=24)
    plain = llm.generate(prompts, params, speculative_algorithm="NONE")
    taus = []
    for size in range(2, 9):
        llm.set_block_size(size)
        for p, s in zip(plain, llm.generate(prompts, params)):
            assert s.token_ids == p.token_ids, size
            taus.append(sum(s.accept_lengths) / len(s.accept_lengths))
    assert max(taus) > 1.2  # the shipped draft's backbone still drafts
