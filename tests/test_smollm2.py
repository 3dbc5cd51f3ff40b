"""Integration on the real embedded SmolLM2-135M-Instruct: numerics and greedy output vs transformers
(dense fp32), the target running its GGUF's own blocks (the CPU default), and DFlash losslessness on both
with a random draft and with the shipped default draft."""

import pytest
import torch

from blockspec import LLM, SamplingParams
from blockspec.layers.forward_batch import ForwardBatch
from blockspec.layers.kv_cache import KVCache
from blockspec.models.config import ModelConfig
from tests.tiny import write_tiny_draft

PROMPT = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(speculative_algorithm="NONE", max_num_seqs=2, max_model_len=1024, quantization="none")


@pytest.fixture(scope="module")
def blocks_llm(smollm2_dir):
    return LLM(speculative_algorithm="NONE", max_num_seqs=2, max_model_len=1024)  # auto: the GGUF's blocks


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def test_logits_and_captured_hidden_match_transformers(llm, hf_model):
    text = llm.tokenizer.apply_chat_template(PROMPT)
    ids = torch.tensor([llm.tokenizer.encode(text)])
    capture = (1, 7, 14, 21, 27, 29)
    cache = KVCache.for_model(llm.target, 1, 256)  # a slab longer than the prompt, as at run time
    with torch.inference_mode():
        hidden, feats = llm.target(ForwardBatch.in_cache(cache, [0], [0], ids), capture)
        ours = llm.target.logits(hidden)
        ref = hf_model(ids, output_hidden_states=True)
    assert (ours - ref.logits).abs().max() < 1e-4, (ours - ref.logits).abs().max()
    expected = torch.cat([ref.hidden_states[i + 1] for i in capture], dim=-1)
    # SmolLM2 carries "massive activations" of magnitude ~750 in some channels, where one float32
    # ulp is 6e-5, and the residual stream mixes them into every channel: hidden states are compared
    # at 1e-4 plus 1e-6 of their largest magnitude (observed: 2.4e-4 against a bound of 8.5e-4).
    diff = (feats - expected).abs().max()
    assert diff < 1e-4 + 1e-6 * expected.abs().max(), diff


def test_greedy_generate_equals_transformers(llm, hf_model):
    text = llm.tokenizer.apply_chat_template(PROMPT)
    ids = llm.tokenizer.encode(text)
    ours = llm.generate([ids], SamplingParams(max_tokens=48))[0]
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False, eos_token_id=[2, 0])
    assert ours.token_ids == ref[0, len(ids) :].tolist()


def prompt_logits(llm: LLM) -> torch.Tensor:
    ids = torch.tensor([llm.tokenizer.encode(llm.tokenizer.apply_chat_template(PROMPT))])
    with torch.inference_mode():
        cache = KVCache.for_model(llm.target, 1, 256)
        return llm.target.logits(llm.target(ForwardBatch.in_cache(cache, [0], [0], ids))[0])[0]


def test_the_gguf_blocks_run_the_same_model(llm, blocks_llm):
    """The default CPU target holds the GGUF's own Q4_1 / Q8_0 blocks (no fp32 copy). With fp32 activations
    its logits are the fp32 model's up to summation order, and its greedy answers are the same tokens; with
    int8 activations (the default) its next-token distributions stay close to those (scripts/
    activation_quality.py measures them on held-out text)."""
    target = blocks_llm.target
    assert blocks_llm.activations == "int8" and target.layers[0].mlp.down_proj.quant.packed
    assert target.layers[0].mlp.down_proj.quant.qtype.name == "q4_1"
    assert (target.embed_tokens.quant.qtype.name == "q8_0"
            and target.lm_head.quant is target.embed_tokens.quant)
    exact = LLM(speculative_algorithm="NONE", max_num_seqs=2, max_model_len=1024, cpu_activations="fp32")
    dense = prompt_logits(llm)
    assert (prompt_logits(exact) - dense).abs().max() < 2e-3
    prompts = [llm.tokenizer.apply_chat_template(PROMPT), "def quicksort(items):"]
    params = SamplingParams(max_tokens=48)
    assert [o.token_ids for o in exact.generate(prompts, params)] == [o.token_ids for o in
                                                                      llm.generate(prompts, params)]
    int8 = prompt_logits(blocks_llm)
    kl = torch.nn.functional.kl_div(int8.log_softmax(-1), dense.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    assert kl.mean() < 0.01 and (int8.argmax(-1) == dense.argmax(-1)).float().mean() > 0.95


@pytest.fixture(scope="module", params=["none", "auto"])
def spec_llm(smollm2_dir, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("draft")
    cfg = ModelConfig.from_folder(smollm2_dir)
    dflash = {"mask_token_id": 1, "target_layer_ids": [1, 14, 27]}
    write_tiny_draft(folder, cfg, block_size=16, dflash_config=dflash)
    # every step a DFlash step (adaptive speculation would mostly decode plainly with a random draft)
    return LLM(draft_model_path=str(folder), max_num_seqs=2, max_model_len=1024, adaptive_speculation=False,
               quantization=request.param)


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_dflash_with_random_draft_is_lossless(spec_llm, block_size):
    spec_llm.set_block_size(block_size)
    prompts = [spec_llm.tokenizer.apply_chat_template(PROMPT), "def quicksort(items):"]
    params = SamplingParams(max_tokens=24)
    plain = spec_llm.generate(prompts, params, speculative_algorithm="NONE")
    fast = spec_llm.generate(prompts, params)
    for p, f in zip(plain, fast):
        assert f.token_ids == p.token_ids
        assert f.speculative_algorithm == "DFLASH" and all(1 <= a <= block_size for a in f.accept_lengths)


def test_default_llm_runs_the_shipped_draft_losslessly(blocks_llm):
    """LLM() loads the shipped default draft (blockspec/drafts/smollm2-135m-dflash, with its draft
    vocabulary) against the real target (its GGUF blocks); greedy output equals plain decoding with adaptive
    speculation and prompt lookup (the defaults), with every step speculating (copies alone, or merged
    with the draft's chain), and with the draft alone, which accepts more than the bonus token on
    average."""
    from blockspec.paths import SHIPPED_DRAFT as DEFAULT_DRAFT

    params = SamplingParams(max_tokens=48)
    plain = blocks_llm.chat(PROMPT, params)[0]
    for adaptive, lookup, merge in ((True, 2, "auto"), (False, 2, "auto"), (False, 2, "always"),
                                    (False, 0, "auto")):
        spec = LLM(max_num_seqs=1, max_model_len=1024, adaptive_speculation=adaptive,
                   prompt_lookup_ngram=lookup, prompt_lookup_merge=merge)
        assert spec.speculative_algorithm == "DFLASH" and spec.runner.draft.vocab.numel() == 16384
        out = spec.chat(PROMPT, params)[0]
        assert out.token_ids == plain.token_ids
        # the answer repeats its own code: copies, alone or merged with the draft's candidates
        copies = out.stats.merged_accept_lengths if merge == "always" else out.stats.lookup_accept_lengths
        assert bool(copies) == bool(lookup)
    assert (DEFAULT_DRAFT / "MODEL_CARD.md").is_file()
    assert sum(out.accept_lengths) / len(out.accept_lengths) > 1.1 and out.stats.plain_steps == 0


def test_candidate_trees_on_the_shipped_draft_are_lossless(blocks_llm):
    """Trees from the shipped draft's top choices at B=4, two prompts in one batch: greedy output equals
    plain decoding at every budget and rule, and a tree accepts more per step than the chain."""
    prompts = [blocks_llm.tokenizer.apply_chat_template(PROMPT), "def quicksort(items):"]
    params = SamplingParams(max_tokens=40)
    plain = blocks_llm.generate(prompts, params)
    spec = LLM(max_num_seqs=2, max_model_len=1024, adaptive_speculation=False, prompt_lookup_ngram=0,
               block_size=4, speculative_tree_budget=20)
    taus = {}
    for budget, rule in ((0, "best-first"), (6, "spine-first"), (20, "best-first")):
        spec.set_tree_budget(budget)
        spec.speculation.tree_rule = rule
        outs = spec.generate(prompts, params)
        assert [o.token_ids for o in outs] == [p.token_ids for p in plain]
        assert all(o.stats.tree_steps == (len(o.accept_lengths) if budget else 0) for o in outs)
        taus[budget] = sum(sum(o.accept_lengths) for o in outs) / sum(len(o.accept_lengths) for o in outs)
    assert taus[20] > taus[0]


def test_batched_long_prompts_give_each_request_its_tokens_alone(smollm2_dir):
    """Four HumanEval prompts (~150 tokens each) decoded together, plainly and with DFlash, prefilled in
    whatever chunks the schedule makes: each request's tokens are its tokens decoded alone (prefill, verify
    and decode are batch- and chunk-invariant on the int8 path)."""
    from blockspec.bench.datasets import load_dataset

    llm = LLM(max_num_seqs=4, max_model_len=1024, prefill_tokens_per_step=96)
    chats = [[{"role": "user", "content": p.turns[0]}] for p in load_dataset("humaneval").prompts[:4]]
    prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(chat)) for chat in chats]
    params = SamplingParams(max_tokens=32)
    alone = [llm.generate([ids], params, speculative_algorithm="NONE")[0].token_ids for ids in prompts]
    assert [o.token_ids for o in llm.generate(prompts, params, speculative_algorithm="NONE")] == alone
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone
