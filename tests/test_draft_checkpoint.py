"""z-lab draft checkpoint format: round trip, reference field names, drafts that carry an embedding."""

import json

import pytest
import torch
from safetensors.torch import save_file

from blockspec.engine.sequence import Sequence
from blockspec.errors import DraftConfigError
from blockspec.layers.forward_batch import ForwardBatch
from blockspec.models.config import ModelConfig
from blockspec.models.loader import load_draft, load_target, save_draft
from blockspec.sampling_params import SamplingParams
from tests.tiny import TinyEngine, write_tiny_draft, write_tiny_target

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_tiny_target(tmp_path_factory.mktemp("t") / "target")


def draft_outputs(target, draft, mask_id=5):
    engine = TinyEngine(target, draft, 4, num_slots=1, max_len=64)
    seq = engine.run([Sequence([3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=12), frozenset())],
                     use_draft=True)[0]
    block = torch.tensor([[seq.pending_token, mask_id, mask_id, mask_id]])
    hidden = draft(ForwardBatch.in_cache(engine.runner.draft_cache, [0], [seq.num_cached], block,
                                         among_new="all"))
    return seq.output_ids, seq.stats.accept_lengths, hidden


def test_save_load_round_trip_is_identical(target_dir, tmp_path):
    cfg = ModelConfig.from_folder(target_dir)
    target = load_target(target_dir, torch.float32, CPU)
    first = load_draft(write_tiny_draft(tmp_path / "a", cfg), cfg, torch.float32, CPU)
    save_draft(first, tmp_path / "b")
    second = load_draft(tmp_path / "b", cfg, torch.float32, CPU)
    a, b = draft_outputs(target, first), draft_outputs(target, second)
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])
    assert (json.loads((tmp_path / "a" / "config.json").read_text())
            == json.loads((tmp_path / "b" / "config.json").read_text()))


def reference_checkpoint(folder, cfg, with_embed: bool = False, vocab: int = 120):
    """A draft written by hand with the reference (z-lab / SGLang) field and tensor names."""
    folder.mkdir(parents=True)
    h, heads, kv, d, inter, layers = cfg.hidden_size, 4, 2, 16, 96, 2
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
        "intermediate_size": inter, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "max_position_embeddings": 40960,
        "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8,
        "use_sliding_window": False,
        "num_target_layers": cfg.num_hidden_layers, "block_size": 8, "tie_word_embeddings": False,
        "dflash_config": {"mask_token_id": 96, "target_layer_ids": [0, 1, 3]},
    }
    g = torch.Generator().manual_seed(0)
    t = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    tensors = {"norm.weight": torch.ones(h), "hidden_norm.weight": torch.ones(h), "fc.weight": t(h, 3 * h)}
    for i in range(layers):
        p = f"layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": t(heads * d, h), p + "self_attn.k_proj.weight": t(kv * d, h),
            p + "self_attn.v_proj.weight": t(kv * d, h), p + "self_attn.o_proj.weight": t(h, heads * d),
            p + "self_attn.q_norm.weight": torch.ones(d), p + "self_attn.k_norm.weight": torch.ones(d),
            p + "mlp.gate_proj.weight": t(inter, h), p + "mlp.up_proj.weight": t(inter, h),
            p + "mlp.down_proj.weight": t(h, inter), p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        })
    if with_embed:
        config["dflash_config"]["has_embed_tokens"] = True
        tensors["embed_tokens.weight"] = t(vocab, h)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_reference_named_checkpoint_loads_and_runs_losslessly(target_dir, tmp_path):
    cfg = ModelConfig.from_folder(target_dir)
    target = load_target(target_dir, torch.float32, CPU)
    draft = load_draft(reference_checkpoint(tmp_path / "ref", cfg), cfg, torch.float32, CPU)
    assert draft.config.target_layer_ids == (0, 1, 3) and draft.config.block_size == 8
    assert draft.layers[1].self_attn.attn.window == 8 and draft.layers[0].self_attn.attn.window is None
    engine = TinyEngine(target, draft, 8, num_slots=2, max_len=128)
    prompts = [list(range(1, 30)), [5, 6]]
    plain = engine.run([Sequence(p, SamplingParams(max_tokens=40), frozenset()) for p in prompts],
                       use_draft=False)
    spec = engine.run([Sequence(p, SamplingParams(max_tokens=40), frozenset()) for p in prompts],
                      use_draft=True)
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]


def test_draft_with_its_own_embedding(target_dir, tmp_path):
    cfg = ModelConfig.from_folder(target_dir)
    target = load_target(target_dir, torch.float32, CPU)
    draft = load_draft(reference_checkpoint(tmp_path / "emb", cfg, with_embed=True), cfg, torch.float32, CPU)
    assert draft.embed_tokens is not None and draft.embed_tokens.weight.shape[0] == 120
    # The mask id 96 is valid for the draft's own 120-row embedding even when checked against it.
    engine = TinyEngine(target, draft, 8, num_slots=1, max_len=64)
    seq = engine.run([Sequence([1, 2, 3], SamplingParams(max_tokens=10), frozenset())], use_draft=True)[0]
    assert len(seq.output_ids) == 10


def test_mask_id_beyond_the_drafts_own_embedding(target_dir, tmp_path):
    cfg = ModelConfig.from_folder(target_dir)
    folder = reference_checkpoint(tmp_path / "small", cfg, with_embed=True, vocab=50)
    with pytest.raises(DraftConfigError, match="mask_token_id=96"):
        load_draft(folder, cfg, torch.float32, CPU)


def test_fc_width_mismatch_names_the_layer_count(target_dir, tmp_path):
    cfg = ModelConfig.from_folder(target_dir)
    folder = reference_checkpoint(tmp_path / "fc", cfg)
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 1]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftConfigError, match="fc.weight"):
        load_draft(folder, cfg, torch.float32, CPU)


def test_draft_vocab_round_trips_and_bad_ones_are_refused(target_dir, tmp_path):
    from safetensors.torch import load_file

    cfg = ModelConfig.from_folder(target_dir)
    draft = load_draft(write_tiny_draft(tmp_path / "a", cfg), cfg, torch.float32, CPU)
    assert draft.vocab is None
    draft.vocab = torch.tensor([0, 5, 9, 40, 96])
    save_draft(draft, tmp_path / "b")
    assert torch.equal(load_draft(tmp_path / "b", cfg, torch.float32, CPU).vocab, draft.vocab)
    tensors = load_file(str(tmp_path / "b" / "model.safetensors"))
    for bad, message in [(torch.tensor([3, 97]), "id 97 is outside \\[0, 97\\)"),
                         (torch.tensor([4, 4]), "repeats"),
                         (torch.tensor([1.0, 2.0]), "integer token ids"),
                         (torch.zeros(2, 2, dtype=torch.long), "1-D")]:
        save_file({**tensors, "draft_vocab": bad}, str(tmp_path / "b" / "model.safetensors"))
        with pytest.raises(DraftConfigError, match=message):
            load_draft(tmp_path / "b", cfg, torch.float32, CPU)
