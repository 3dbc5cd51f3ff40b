"""The GPU path without a GPU: the engine and train-draft run end to end on a stand-in device (fake_gpu.py)
that enforces CUDA's device rules, so a tensor left on the CPU fails here, in CI, instead of on a GPU."""

from unittest import mock

import pytest
import torch

import blockspec.train.trainer as trainer
from blockspec.models.config import ModelConfig
from blockspec.llm import LLM
from blockspec.models.loader import load_draft
from blockspec.sampling_params import SamplingParams
from blockspec.train.trainer import train
from tests.fake_gpu import FAKE_GPU, FakeGpuTensor, fake_gpu
from tests.test_train import _cfg, write_char_tokenizer, write_motif_text
from tests.tiny import write_tiny_draft, write_tiny_target, write_tiny_tokenizer

CPU = torch.device("cpu")
PROMPTS = [[3, 4, 5, 6, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fake-gpu")
    write_tiny_tokenizer(write_tiny_target(folder / "target"))
    write_tiny_draft(folder / "draft", ModelConfig.from_folder(folder / "target"), block_size=8)
    return folder


def test_the_stand_in_enforces_cudas_device_rules():
    with fake_gpu():
        x = torch.arange(4.0).to(FAKE_GPU)
        assert isinstance(x, FakeGpuTensor) and x.device == FAKE_GPU
        assert (x + torch.tensor(1.0)).tolist() == [1.0, 2.0, 3.0, 4.0]  # 0-dim CPU scalars are fine
        # CPU indices too
        assert x[torch.tensor([0, 2])].tolist() == [0.0, 2.0] and x[[1, 3]].tolist() == [1.0, 3.0]
        assert torch.zeros(2, device=FAKE_GPU).device == FAKE_GPU and x.cpu().device == CPU
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(4)
        with pytest.raises(RuntimeError, match="same device"):
            torch.cat([x, torch.ones(1)])
        with pytest.raises(RuntimeError, match="generator"):
            torch.multinomial(x.softmax(0), 1, generator=torch.Generator())
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()


@pytest.mark.parametrize("block_size, merge", [(2, "auto"), (4, "auto"), (8, "auto"), (4, "always")])
def test_engine_on_the_device_equals_the_cpu(tiny, block_size, merge):
    """Greedy DFlash (with prompt lookup, its copies alone or merged with the draft's candidates) on the
    device == plain decoding on the CPU, and a seeded sampled request draws the same tokens on both (its
    draws are keyed by seed and position and made on the CPU)."""
    greedy, sampled = SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, temperature=1.0, seed=7)
    cpu = LLM(model_path=str(tiny / "target"), draft_model_path=str(tiny / "draft"), block_size=block_size,
              device="cpu", adaptive_speculation=False, prompt_lookup_merge=merge)
    plain = [o.token_ids for o in LLM(model_path=str(tiny / "target"), speculative_algorithm="NONE",
                                       device="cpu").generate(PROMPTS, greedy)]
    with fake_gpu():
        gpu = LLM(model_path=str(tiny / "target"), draft_model_path=str(tiny / "draft"),
                  block_size=block_size, device=FAKE_GPU, adaptive_speculation=False,
                  prompt_lookup_merge=merge)
        assert (isinstance(gpu.target.lm_head.weight, FakeGpuTensor)
                and isinstance(gpu.draft.fc.weight, FakeGpuTensor))
        outs = gpu.generate(PROMPTS, greedy)
        assert [o.token_ids for o in outs] == plain
        assert any(o.stats.merged_accept_lengths for o in outs) == (merge == "always")
        on_gpu = [o.token_ids for o in gpu.generate(PROMPTS, sampled)]
    assert on_gpu == [o.token_ids for o in cpu.generate(PROMPTS, sampled)]


def test_penalties_logprobs_and_stops_on_the_device(tiny):
    """The request fields that need the target's logits (penalties, logprobs) and stop strings, on the device:
    greedy DFlash there equals plain decoding on the CPU, logprobs included."""
    params = SamplingParams(max_tokens=24, presence_penalty=0.7, frequency_penalty=0.4, logprobs=2,
                            stop=["zz"], ignore_eos=True)
    cpu = LLM(model_path=str(tiny / "target"), speculative_algorithm="NONE", device="cpu")
    plain = cpu.generate(PROMPTS, params)
    with fake_gpu():
        gpu = LLM(model_path=str(tiny / "target"), draft_model_path=str(tiny / "draft"), device=FAKE_GPU,
                  adaptive_speculation=False)
        spec = gpu.generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for s, p in zip(spec, plain):
        assert [e.token_id for e in s.logprobs] == s.token_ids
        assert [e.logprob for e in s.logprobs] == pytest.approx([e.logprob for e in p.logprobs], abs=1e-4)


@pytest.mark.parametrize("tree, accept", [(0, "match"), (6, "match"), (0, "rejection"), (6, "rejection")])
def test_a_dflash2_draft_on_the_device_equals_the_cpu(tiny, tree, accept):
    """A DFlash2 draft (its convolutions, candidates, lattice, walk and selector trees) on the device: greedy
    equals plain decoding on the CPU; seeded sampled requests (the walk drawing its proposals under
    "rejection") draw what the same engine draws on the CPU."""
    from tests.test_dflash2 import write_checkpoint

    if not (tiny / "d2").exists():
        write_checkpoint(tiny / "d2", ModelConfig.from_folder(tiny / "target"), tiny / "draft")
    kwargs = dict(model_path=str(tiny / "target"), draft_model_path=str(tiny / "d2"), block_size=4,
                  adaptive_speculation=False, prompt_lookup_ngram=0, speculative_tree_budget=tree,
                  speculative_tree_topk=2, speculative_accept=accept)
    greedy, sampled = SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, temperature=1.0, seed=7)
    plain = [o.token_ids for o in LLM(model_path=str(tiny / "target"), speculative_algorithm="NONE",
                                       device="cpu").generate(PROMPTS, greedy)]
    cpu = LLM(device="cpu", **kwargs)
    with fake_gpu():
        gpu = LLM(device=FAKE_GPU, **kwargs)
        assert isinstance(gpu.draft.candidate_selector.predecessor_codebook, FakeGpuTensor)
        assert [o.token_ids for o in gpu.generate(PROMPTS, greedy)] == plain
        on_gpu = gpu.generate(PROMPTS, sampled)
        assert all(o.stats.tree_steps == (len(o.accept_lengths) if tree else 0) for o in on_gpu)
    assert [o.token_ids for o in on_gpu] == [o.token_ids for o in cpu.generate(PROMPTS, sampled)]


@pytest.mark.parametrize("features", ["online", "disk"])
def test_train_draft_on_the_device(tmp_path, features):
    """On-policy responses, target features (per batch or extracted), distillation, a training vocabulary,
    evaluation and saving, all on the device."""
    target = write_tiny_target(tmp_path / "target", vocab_size=101, max_position_embeddings=1024)
    write_char_tokenizer(target)
    write_motif_text(tmp_path / "text.jsonl", 40)
    cfg = _cfg(tmp_path, tmp_path / "draft", target=str(target),
               data=f"responses:4,{tmp_path / 'text.jsonl'}",
               mask_token_id=None, seq_len=1024, response_tokens=12, gen_batch_size=3, steps=3, eval_every=3,
               features=features, distill=0.5, train_vocab=50, train_dtype="float32")
    seen = []
    real_step = torch.optim.AdamW.step

    def step(self, *args, **kwargs):  # the parameters the optimizer updates live on the device
        seen.extend(isinstance(p, FakeGpuTensor) for group in self.param_groups for p in group["params"])
        return real_step(self, *args, **kwargs)

    with fake_gpu(), mock.patch.object(trainer, "resolve_device", lambda name: FAKE_GPU), \
            mock.patch.object(torch.optim.AdamW, "step", step):
        summary = train(cfg)
    assert summary["step"] == 3 and summary["heldout_tau"] >= 1.0 and seen and all(seen)
    draft = load_draft(tmp_path / "draft", ModelConfig.from_folder(target), torch.float32, CPU,
                       token_to_id={"<mask>": 4}.get)
    assert draft.config.block_size == 4
