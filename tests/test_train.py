"""train-draft: the training mask, loss weights, anchors, train/inference agreement, resume, smoke runs."""

import json
import math
import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockspec.cli import main
from blockspec.errors import BlockspecError
from blockspec.layers.embedding import Embedding, LMHead
from blockspec.layers.forward_batch import ForwardBatch
from blockspec.layers.kv_cache import KVCache
from blockspec.models.config import ModelConfig
from blockspec.models.draft import DFlashDraft
from blockspec.models.draft_config import resolve_draft_config
from blockspec.models.loader import load_draft
from blockspec.train.config import TrainConfig
from blockspec.train import data as D
from blockspec.train.data import DataSpec, TrainSequence
from blockspec.train.features import causal_batch, target_features, target_identity
from blockspec.train.objective import (IGNORE, Blocks, TrainVocab, build_blocks, cosine_with_warmup,
                                       dflash_loss, greedy_accept_lengths, loss_weights, sample_anchors,
                                       steps_in_budget, training_mask)
from blockspec.train.prompts import TOPICS, response_prompts
from blockspec.train.trainer import train
from tests.tiny import tiny_draft_raw, write_tiny_target

CPU = torch.device("cpu")


def test_training_mask_exact_pattern():
    # two blocks of B=3 anchored at 2 and 4, context length 6: keys = 6 context + 6 block slots
    context, own = training_mask(torch.tensor([[2, 4]]), block_size=3, ctx_len=6)
    mask = torch.cat([context, own], dim=-1)[0].int()
    a = [1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0]  # block 0: context < 2, own block
    b = [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]  # block 1: context < 4, own block
    assert mask.tolist() == [a, a, a, b, b, b]


def test_loss_weights_follow_the_paper():
    w = loss_weights(16)
    assert w.shape == (15,)
    assert w[0] == 1.0
    assert torch.allclose(w, torch.exp(-torch.arange(15.0) / 7.0))
    assert torch.allclose(loss_weights(8), torch.exp(-torch.arange(7.0) / 4.0))
    assert torch.allclose(loss_weights(10), torch.exp(-torch.arange(9.0) / 5.0))
    assert torch.allclose(loss_weights(4, gamma=2.0), torch.exp(-torch.arange(3.0) / 2.0))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=4), count=st.integers(1, 12),
       data=st.data())
def test_anchors_stay_in_bounds(lengths, count, data):
    starts = [data.draw(st.integers(0, max(0, n))) for n in lengths]
    anchors, valid = sample_anchors(lengths, starts, count, torch.Generator().manual_seed(0))
    for row, (n, s) in enumerate(zip(lengths, starts)):
        picked = anchors[row][valid[row]].tolist()
        lo, hi = max(1, s), n - 2
        assert len(picked) == max(0, min(count, hi - lo + 1))
        assert len(set(picked)) == len(picked) and picked == sorted(picked)
        assert all(lo <= a <= hi for a in picked)  # context before, >= 1 label after


def test_blocks_labels_positions_and_ignore():
    ids = torch.arange(10, 20).view(1, -1)  # tokens 10..19 at positions 0..9
    labels = torch.arange(11, 21).view(1, -1)  # label[t] predicts position t + 1 and agrees with the text
    blocks = build_blocks(ids, labels, [8], torch.tensor([[2, 6]]), torch.tensor([[True, True]]), 4,
                          mask_token_id=7)
    assert blocks.input_ids.tolist() == [[12, 7, 7, 7, 16, 7, 7, 7]]
    assert blocks.positions.tolist() == [[2, 3, 4, 5, 6, 7, 8, 9]]
    # slot k predicts position a + k: labels[a + k - 1]; positions past the sequence (length 8) are ignored
    assert blocks.labels.tolist() == [[[13, 14, 15], [17, IGNORE, IGNORE]]]


@pytest.mark.parametrize("block_size", [2, 3, 4, 6])
def test_labels_stop_where_the_text_leaves_the_greedy_path(block_size):
    """Teacher-forced text: slot k keeps its label only while x[a+j] == y[a+j-1] for all j < k."""
    gen = torch.Generator().manual_seed(block_size)
    ids = torch.randint(0, 3, (2, 24), generator=gen)
    labels = torch.randint(0, 3, (2, 24), generator=gen)
    anchors = torch.tensor([[1, 5, 9, 20], [2, 3, 11, 19]])
    blocks = build_blocks(ids, labels, [24, 22], anchors, torch.ones(2, 4, dtype=torch.bool), block_size, 9)
    for row, length in enumerate([24, 22]):
        for j, a in enumerate(anchors[row].tolist()):
            want = []
            for k in range(1, block_size):
                on_path = all(ids[row, a + i] == labels[row, a + i - 1] for i in range(1, k))
                want.append(int(labels[row, a + k - 1]) if a + k <= length - 1 and on_path else IGNORE)
            assert blocks.labels[row, j].tolist() == want


def test_cosine_schedule_warms_up_then_decays():
    values = [cosine_with_warmup(s, 100, 10) for s in range(100)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[9:], values[10:])) and values[-1] < 0.01


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train")
    write_tiny_target(folder / "target", num_hidden_layers=4)
    write_motif_text(folder / "data.jsonl", 120)
    return folder


def write_motif_text(path, rows: int) -> None:
    """Repetitive token streams as `--data` JSONL: something learnable."""
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(rows):
            motif = [rng.randrange(10, 97) for _ in range(rng.randint(3, 6))]
            f.write(json.dumps({"token_ids": (motif * 20)[: rng.randint(40, 80)]}) + "\n")


def random_embedding(vocab: int, hidden: int) -> Embedding:
    embedding = Embedding(vocab, hidden)
    embedding.load("weight", torch.randn(vocab, hidden))
    return embedding


def test_forward_train_matches_inference_path(tiny):
    """Each block of the one-pass training forward equals the engine's inject + forward for that anchor."""
    cfg = ModelConfig.from_folder(tiny / "target")
    dcfg = resolve_draft_config(tiny_draft_raw(cfg, block_size=4), target=cfg)
    torch.manual_seed(0)
    draft = DFlashDraft(dcfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    draft.use_target_embedding(random_embedding(97, cfg.hidden_size))
    t, width = 12, 2 * cfg.hidden_size
    feats = torch.randn(1, t, width)
    ids = torch.randint(0, 97, (1, t))
    anchors = torch.tensor([[1, 5, 9]])
    blocks = build_blocks(ids, ids, [t], anchors, torch.ones(1, 3, dtype=torch.bool), 4, dcfg.mask_token_id)
    with torch.no_grad():
        out = draft(blocks.forward_batch(), feats)
        for j, a in enumerate(anchors[0].tolist()):
            cache = KVCache.for_model(draft, 1, 32)
            draft.inject(feats[:, :a], ForwardBatch.in_cache(cache, [0], [0], num_new=a))
            block = blocks.input_ids[:, 4 * j : 4 * j + 4]
            ref = draft(ForwardBatch.in_cache(cache, [0], [a], block, among_new="all"))
            assert torch.allclose(out[:, 4 * j : 4 * j + 4], ref, atol=1e-5)


def test_on_policy_labels_are_the_response(tiny):
    from blockspec.models.loader import load_target

    target = load_target(tiny / "target", torch.float32, CPU)
    seq = TrainSequence([5, 6, 7, 8, 9, 10], start=3, on_policy=True)
    plain = TrainSequence([5, 6, 7, 8, 9, 10], start=1, on_policy=False)
    (feats, labels), (_, argmax) = target_features(target, [seq, plain], (0, 2))
    assert feats.shape == (6, 128) and feats.dtype.name == "float16"
    assert labels[3:5].tolist() == [9, 10] and labels[:3].tolist() == argmax[:3].tolist()


def _cfg(tiny, out, **kw) -> TrainConfig:
    base = dict(output=out, target=str(tiny / "target"), data=str(tiny / "data.jsonl"), num_draft_layers=1,
                block_size=4, target_layer_ids=(0, 2), mask_token_id=5, seq_len=64, batch_size=4,
                anchors_per_seq=8, eval_seqs=2, eval_every=10, save_every=1000, device="cpu",
                cache_dir=tiny / "cache", save_dtype="float32", lr=3e-3)
    base.update(kw)
    return TrainConfig(**base)


def test_smoke_training_loss_decreases_and_loads(tiny):
    out = tiny / "draft"
    summary = train(_cfg(tiny, out, steps=60, lr=1e-2))
    state = torch.load(out / "checkpoint" / "state.pt", weights_only=False)
    losses = [r["loss"] for r in state["history"]]
    assert len(losses) == 60 and summary["step"] == 60
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.3  # ~4.5 (uniform over 97) -> ~3.9
    assert math.isfinite(summary["heldout_tau"]) and 1.0 <= summary["heldout_tau"] <= 4.0
    draft = load_draft(out, ModelConfig.from_folder(tiny / "target"), torch.float32, CPU)
    assert draft.config.block_size == 4 and draft.config.target_layer_ids == (0, 2)
    card = (out / "MODEL_CARD.md").read_text()
    assert "held-out" in card.lower() and "60 of 60 steps" in card
    with pytest.raises(BlockspecError, match="resume=True"):  # never silently overwrite a run
        train(_cfg(tiny, out, steps=60, lr=1e-2))


def test_resume_equals_uninterrupted(tiny):
    straight = tiny / "straight"
    train(_cfg(tiny, straight, steps=6, eval_every=3))
    split = tiny / "split"
    first = train(_cfg(tiny, split, steps=6, eval_every=3, stop_after_steps=3))
    assert first["step"] == 3
    with pytest.raises(BlockspecError, match="other settings"):
        train(_cfg(tiny, split, steps=6, eval_every=3, lr=1e-3, resume=True))
    second = train(_cfg(tiny, split, steps=6, eval_every=3, resume=True))
    assert second["step"] == 6
    a = torch.load(straight / "checkpoint" / "state.pt", weights_only=False)
    b = torch.load(split / "checkpoint" / "state.pt", weights_only=False)
    for name, tensor in a["draft"].items():
        assert torch.equal(tensor, b["draft"][name]), name
    assert a["history"] == b["history"]


def test_init_from_a_draft_folder_continues_its_weights(tiny):
    first = tiny / "warm-a"
    train(_cfg(tiny, first, steps=4, train_dtype="float32"))
    again = tiny / "warm-b"
    summary = train(_cfg(tiny, again, steps=1, lr=1e-9, init=str(first), train_dtype="float32"))
    assert summary["step"] == 1
    a = torch.load(first / "checkpoint" / "state.pt", weights_only=False)["draft"]
    b = torch.load(again / "checkpoint" / "state.pt", weights_only=False)["draft"]
    for name, tensor in a.items():  # one step at lr 1e-9 leaves the loaded weights in place
        assert torch.allclose(tensor, b[name], atol=1e-6), name
    # another block size is a fine-tune of the same weights (a draft trained at B=16 may be tuned for B=4)
    assert train(_cfg(tiny, tiny / "warm-c", steps=1, block_size=8, init=str(first),
                      train_dtype="float32"))["step"] == 1
    # a deeper draft grows from it: the new layer starts as an identity residual block (same outputs)
    grown = tiny / "warm-e"
    train(_cfg(tiny, grown, steps=1, lr=1e-9, num_draft_layers=2, init=str(first), train_dtype="float32"))
    cfg = ModelConfig.from_folder(tiny / "target")
    small, deep = (load_draft(d, cfg, torch.float32, CPU) for d in (first, grown))
    assert deep.config.num_hidden_layers == 2
    embedding = random_embedding(97, cfg.hidden_size)
    feats, block = torch.randn(1, 7, 2 * cfg.hidden_size), torch.randint(0, 97, (1, 4))
    out = []
    with torch.no_grad():
        for draft in (small, deep):
            draft.use_target_embedding(embedding)
            cache = KVCache.for_model(draft, 1, 32)
            draft.inject(feats, ForwardBatch.in_cache(cache, [0], [0], num_new=7))
            out.append(draft(ForwardBatch.in_cache(cache, [0], [7], block, among_new="all")))
    assert torch.allclose(*out, atol=1e-4)
    with pytest.raises(BlockspecError, match="num_hidden_layers=2, but this run trains num_hidden_layers=1"):
        train(_cfg(tiny, tiny / "warm-f", steps=1, num_draft_layers=1, init=str(grown)))
    with pytest.raises(BlockspecError, match="init="):
        _cfg(tiny, tiny / "warm-d", init=str(tiny / "nowhere"))


def test_sources_are_cached_apart_and_share_the_token_cap(tiny):
    """Each source has its own feature store: adding a source re-extracts only that one; --tokens is
    split between the sources (a finite one first, the rest getting what it leaves)."""
    cache = tiny / "mix-cache"
    other = tiny / "other.jsonl"
    other.write_text("".join(json.dumps({"token_ids": list(range(10, 60)) * 3}) + "\n" for _ in range(40)))
    first = train(_cfg(tiny, tiny / "mix-a", steps=1, cache_dir=cache))
    a_tokens = first["extract_train"]["tokens"]
    both = train(_cfg(tiny, tiny / "mix-b", steps=1, cache_dir=cache, data=f"{tiny / 'data.jsonl'},{other}"))
    # only the new source (64-token windows, short tails dropped)
    assert both["extract_train"]["tokens"] == 40 * 128
    capped = train(_cfg(tiny, tiny / "mix-c", steps=1, cache_dir=cache,
                        data=f"{tiny / 'data.jsonl'},{other}", tokens=1000))
    model_card = (tiny / "mix-c" / "MODEL_CARD.md").read_text()
    assert a_tokens > 1000 and "extract_train" not in capped
    assert re.search(r"(\d+) training sequences, (\d+) tokens", model_card)
    got = int(re.search(r"training sequences, (\d+) tokens", model_card).group(1))
    assert 1000 <= got < 1000 + 2 * 80  # each source stops at the sequence that reaches its share
    used = [int(t) for t in re.findall(r"\((\d+) sequences, \d+ tokens used\)", model_card)]
    assert len(used) == 2 and sum(capped["sources"][s]["tokens"] for s in capped["sources"]) == got


def test_bf16_autocast_with_a_train_vocab_runs_and_learns(tiny):
    summary = train(_cfg(tiny, tiny / "bf16", steps=30, lr=1e-2, train_dtype="bfloat16", train_vocab=48))
    assert summary["train_vocab"]["size"] == 48 and 0.5 < summary["train_vocab"]["label_coverage"] <= 1.0
    state = torch.load(tiny / "bf16" / "checkpoint" / "state.pt", weights_only=False)
    losses = [r["loss"] for r in state["history"]]
    assert all(math.isfinite(x) for x in losses) and sum(losses[-5:]) < sum(losses[:5])
    assert all(t.dtype == torch.float32 for t in state["draft"].values())  # fp32 master weights
    assert summary["step"] == 30
    target_cfg = ModelConfig.from_folder(tiny / "target")
    draft = load_draft(tiny / "bf16", target_cfg, torch.float32, CPU)  # proposes from the 48 trained tokens
    assert draft.vocab.numel() == 48 and bool((draft.vocab[1:] > draft.vocab[:-1]).all())


def test_cli_trains_and_reports_errors(tiny, capsys):
    out = tiny / "cli"
    argv = ["train-draft", "--target", str(tiny / "target"), "--output", str(out),
            "--data", str(tiny / "data.jsonl"),
            "--block-size", "4", "--target-layer-ids", "0,2", "--mask-token-id", "5", "--seq-len", "64",
            "--steps", "3", "--anchors-per-seq", "4", "--eval-seqs", "2", "--device", "cpu",
            "--cache-dir", str(tiny / "cache"), "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 3 and (out / "model.safetensors").is_file()
    assert main(argv[:-1] + ["--data", "humaneval"]) == 2
    assert "unknown source" in capsys.readouterr().err


def test_data_spec_parsing(tmp_path):
    (tmp_path / "x.jsonl").write_text("")
    spec = DataSpec.parse(f"stdlib, responses:12,{tmp_path / 'x.jsonl'}")
    assert spec.sources[:2] == ("stdlib", "responses:12") and spec.num_responses == 12
    for bad in ("responses:0", "gsm8k", "missing.jsonl", ""):
        with pytest.raises(BlockspecError):
            DataSpec.parse(bad)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_char_tokenizer(folder) -> int:
    """A character-level tokenizer.json with ChatML specials and a <mask> token; returns its size."""
    from tokenizers import AddedToken, Tokenizer, models

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<mask>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(c) for c in range(32, 127)] + ["\n"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": CHATML}))
    return len(vocab)


def test_on_policy_responses_are_generated_cached_and_trained_on(tmp_path):
    target = write_tiny_target(tmp_path / "target", vocab_size=101, max_position_embeddings=1024)
    write_char_tokenizer(target)
    cfg = _cfg(tmp_path, tmp_path / "draft", target=str(target), data="responses:3", mask_token_id=None,
               seq_len=1024, response_tokens=12, gen_batch_size=3, steps=2, eval_every=2)
    summary = train(cfg)
    assert summary["step"] == 2 and summary["extract_train"]["tokens"] > 0
    rows = [json.loads(line) for f in (tmp_path / "cache" / "responses").glob("*-train.jsonl")
            for line in f.read_text().splitlines()]
    assert len(rows) == 3 and all(1 <= len(r["output_ids"]) <= 12 for r in rows)
    from blockspec.train.features import FeatureStore

    (store_dir,) = [d for d in (tmp_path / "cache" / "features").iterdir()
                    if json.loads((d / "meta.json").read_text())["key"]["split"] == "train"]
    store = FeatureStore(store_dir, {})
    for i, row in enumerate(rows):  # labels inside the response are the response's next tokens
        ids, labels, _, start = store.get(i)
        assert ids.tolist() == row["prompt_ids"] + row["output_ids"] and start == len(row["prompt_ids"])
        assert labels[start:-1].tolist() == row["output_ids"][1:]
    draft = load_draft(tmp_path / "draft", ModelConfig.from_folder(target), torch.float32, CPU,
                       token_to_id={"<mask>": 4}.get)
    assert draft.config.mask_token_id == 4 and draft.config.mask_token == "<mask>"  # picked automatically
    again = train(_cfg(tmp_path, tmp_path / "draft2", target=str(target), data="responses:3",
                       mask_token_id=None, seq_len=1024, response_tokens=12, gen_batch_size=3, steps=2,
                       eval_every=2))
    assert "extract_train" not in again  # responses and features come from the cache
    more = train(_cfg(tmp_path, tmp_path / "draft3", target=str(target), data="responses:5",
                      mask_token_id=None, seq_len=1024, response_tokens=12, gen_batch_size=3, steps=2,
                      eval_every=2))
    rows = [json.loads(line) for f in (tmp_path / "cache" / "responses").glob("*-train.jsonl")
            for line in f.read_text().splitlines()]
    new_tokens = sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in rows[3:])
    assert len(rows) == 5 and more["extract_train"]["tokens"] == new_tokens  # only the 2 new responses
    online = train(_cfg(tmp_path, tmp_path / "draft4", target=str(target), data="responses:5",
                        mask_token_id=None, seq_len=1024, response_tokens=12, gen_batch_size=3, steps=2,
                        eval_every=2, features="online"))
    assert online["step"] == 2 and math.isfinite(online["heldout_tau"]) and "extract_train" not in online


def test_an_interrupted_response_cache_loses_only_its_partial_line(tmp_path):
    cache = tmp_path / "r.jsonl"
    good = [{"prompt_ids": [1, 2], "output_ids": [3]}, {"prompt_ids": [4], "output_ids": [5, 6]}]
    cache.write_text("".join(json.dumps(r) + "\n" for r in good) + '{"prompt_ids": [7, ')
    assert D._read_rows(cache) == good
    assert cache.read_text().splitlines() == [json.dumps(r) for r in good]  # appendable again
    cache.write_text('{"prompt_ids": [7, \n' + json.dumps(good[0]) + "\n")
    with pytest.raises(BlockspecError, match="line 1 is not JSON"):
        D._read_rows(cache)


def test_more_responses_extend_the_cache_without_repeating_a_prompt(tmp_path):
    from blockspec.train.data import ensure_responses

    target = write_tiny_target(tmp_path / "target", vocab_size=101, max_position_embeddings=1024)
    write_char_tokenizer(target)
    cache = tmp_path / "responses.jsonl"

    def rows(count: int) -> list[dict]:
        return ensure_responses(cache, target, count, False, 1024, 4, 0, "cpu", "float32", 4)

    first = rows(20)
    more = rows(40)  # a larger count draws a different prompt list (here one of the 20 answered again)
    assert more[:20] == first and len(cache.read_text().splitlines()) == 40
    assert len({tuple(r["prompt_ids"]) for r in more}) == 40


def test_stdlib_source_excludes_tests_and_heldout_modules():
    import sysconfig

    from blockspec.train.data import stdlib_files

    root = sysconfig.get_paths()["stdlib"]
    train_files, heldout = stdlib_files(False), stdlib_files(True)
    assert len(train_files) > 500 and heldout
    for path in train_files:
        rel = path.relative_to(root).parts
        assert (not {"test", "tests", "idle_test", "site-packages"} & set(rel)
                and not rel[-1].startswith("test_"))
        assert rel[0].removesuffix(".py") not in ("json", "email")
    assert all(path.relative_to(root).parts[0] in ("json", "email") for path in heldout)


def test_missing_pydoc_is_skipped_with_a_warning(monkeypatch, tmp_path, caplog):
    from blockspec.train import data

    monkeypatch.setattr(data, "PYDOC_ROOT", tmp_path / "absent")
    assert data.pydoc_files(False) == []
    assert "apt-get install python3.11-doc" in caplog.text


def test_response_prompts_are_varied_unique_and_split():
    stdlib = D.stdlib_files(False)[:200]
    train_prompts = response_prompts(200, False, 0, stdlib, [])
    held = response_prompts(40, True, 0, D.stdlib_files(True), [])
    assert len(train_prompts) == 200 == len(set(train_prompts)) and len(held) == 40
    assert any("```python" in p for p in train_prompts) and any("```" not in p for p in train_prompts)
    # long: no accidental substrings
    held_topics = [t for i, t in enumerate(TOPICS) if i % 5 == 4 and len(t) > 8]
    assert held_topics and not any(t in p for p in train_prompts for t in held_topics)
    assert response_prompts(200, False, 0, stdlib, []) == train_prompts  # seeded


def test_train_vocab_restricts_the_softmax_and_skips_rare_labels():
    head = LMHead(8, 10)
    head.load("lm_head.weight", torch.randn(10, 8))
    counts = torch.tensor([5, 0, 9, 1, 0, 7, 0, 0, 3, 2])
    vocab = TrainVocab(head, counts, 4)
    assert (vocab.size == 4 and vocab(torch.randn(3, 8)).shape == (3, 4)
            and abs(vocab.coverage - 24 / 27) < 1e-6)
    assert vocab.labels(torch.tensor([2, 3, IGNORE, 8, 0])).tolist() == [1, IGNORE, IGNORE, 3, 0]
    # a vocabulary of every token gives exactly the full-softmax loss
    full = TrainVocab(head, counts + 1, 10)
    b, count, block = 2, 3, 4
    hidden = torch.randn(b, count * block, 8)
    labels = torch.randint(0, 10, (b, count, block - 1))
    blocks = Blocks(input_ids=None, positions=None, labels=labels, context_visible=None, own_block=None,
                    valid=None, complete=None)
    w = loss_weights(block)
    a, _ = dflash_loss(hidden, head, blocks, w)
    c, _ = dflash_loss(hidden, head, blocks, w, full)
    assert torch.allclose(a, c, atol=1e-6)
    # the held-out tau ranks over the vocabulary, mapping back to token ids: same as the full head here,
    # and with a smaller vocabulary every proposal is one of its tokens
    blocks.complete = torch.ones(b, count, dtype=torch.bool)
    assert torch.equal(greedy_accept_lengths(hidden, head, blocks),
                       greedy_accept_lengths(hidden, head, blocks, full))
    predicted_rows = hidden.view(b, count, block, 8)[:, :, 1:]
    blocks.labels = vocab.ids[vocab(predicted_rows).argmax(-1)]  # labels = the vocabulary's argmax tokens
    assert greedy_accept_lengths(hidden, head, blocks, vocab).tolist() == [float(block)] * (b * count)


def test_target_identity_follows_content_not_mtime(tmp_path) -> None:
    """A re-made but identical checkpoint keeps its feature/response caches; changed weights do not."""
    import os

    from tests.tiny import write_tiny_target

    write_tiny_target(tmp_path, "llama")
    before = target_identity(tmp_path)
    weights = next(tmp_path.glob("*.safetensors"))
    os.utime(weights, ns=(1, 1))
    assert target_identity(tmp_path) == before
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert target_identity(tmp_path) != before


def test_distillation_teacher_is_the_targets_own_distribution(tiny):
    """The soft labels come from the cached features of the deepest tapped layer run through the target's
    remaining layers: they must equal the target's own full forward at the positions the slots predict
    from."""
    from blockspec.models.loader import load_target
    from blockspec.train.trainer import Trainer

    cfg = _cfg(tiny, tiny / "kd-probe", distill=0.5, train_dtype="float32", dtype="float32")
    trainer = Trainer(cfg)
    trainer.prepare_data()
    trainer.attach_draft(DFlashDraft(trainer.draft_cfg))
    reference = load_target(tiny / "target", torch.float32, CPU)
    trainer.freeze_target()
    batch = trainer.batches.get("train", [0, 1])
    _, blocks, _, teacher = trainer.forward(batch, 4, torch.Generator().manual_seed(0), teacher=True)
    ids, _, _, lengths, _ = batch
    t = ids.shape[1]
    with torch.no_grad():
        full = reference.norm(reference(causal_batch(ids))[0])
    from_pos = blocks.positions.view(2, -1, 4)[:, :, :-1]
    for row in range(2):
        for j in range(from_pos.shape[1]):
            for k in range(3):
                p = int(from_pos[row, j, k])
                if p < lengths[row]:  # features are stored in fp16
                    assert torch.allclose(teacher[row, j, k], full[row, p], atol=2e-2), (row, j, k)


def test_distillation_trains_and_is_validated(tiny):
    summary = train(_cfg(tiny, tiny / "kd", steps=30, lr=1e-2, distill=0.5, train_vocab=48))
    state = torch.load(tiny / "kd" / "checkpoint" / "state.pt", weights_only=False)
    losses = [r["loss"] for r in state["history"]]
    assert (summary["step"] == 30 and all(math.isfinite(x) for x in losses)
            and sum(losses[-5:]) < sum(losses[:5]))
    assert (load_draft(tiny / "kd", ModelConfig.from_folder(tiny / "target"), torch.float32, CPU)
            .vocab.numel() == 48)
    for bad in (-0.1, 1.5, True):
        with pytest.raises(BlockspecError, match="distill="):
            _cfg(tiny, tiny / "kd-bad", distill=bad)


def test_online_features_equal_the_extracted_ones(tiny):
    """--features online runs the target per batch: the same features (disk keeps them in fp16), the same
    labels, and the same distillation teacher as the disk path, from sequences held in memory."""
    from blockspec.train.teacher import target_pass, teacher_hidden
    from blockspec.train.trainer import Trainer

    pair = []
    for mode in ("disk", "online"):
        trainer = Trainer(_cfg(tiny, tiny / f"feat-{mode}", features=mode, dtype="float32", distill=0.5))
        trainer.prepare_data()
        trainer.freeze_target()
        pair.append(trainer)
    disk, online = pair
    assert online.online and not disk.online and online.stats["features"] == "online"
    assert ((online.num_train, online.num_eval, online.train_tokens)
            == (disk.num_train, disk.num_eval, disk.train_tokens))
    ids, labels, feats, lengths, starts = disk.batches.get("train", [3, 7, 11])
    o_ids, o_labels, o_feats, *_ = online.batches.get("train", [3, 7, 11])
    assert o_feats is None and torch.equal(ids, o_ids)
    # text: the target decides
    assert all(bool((o_labels[row, :n] == -1).all()) for row, n in enumerate(lengths))
    layer_ids = online.draft_cfg.target_layer_ids
    got_feats, got_labels, final = target_pass(online.target, o_ids, o_labels, layer_ids)
    for row, n in enumerate(lengths):
        assert torch.equal(got_labels[row, :n], labels[row, :n])
        assert torch.allclose(got_feats[row, :n], feats[row, :n].float(), atol=2e-2)
    gen = torch.Generator().manual_seed(1)
    blocks = build_blocks(ids, labels, lengths, *sample_anchors(lengths, starts, 4, gen), 4, 5)
    want = teacher_hidden(disk.target, feats.float(), blocks, layer_ids)
    got = teacher_hidden(online.target, got_feats, blocks, layer_ids, final)
    from_pos = blocks.positions.view(3, -1, 4)[:, :, :-1]
    # padding differs (zeros on disk, pad tokens online)
    real = from_pos < torch.tensor(lengths).view(3, 1, 1)
    assert bool(real.any()) and torch.allclose(got[real], want[real], atol=2e-2)


def test_sequence_store_caps_and_labels():
    from blockspec.train.features import SequenceStore

    seqs = [TrainSequence([5, 6, 7, 8], 2, True), TrainSequence([1, 2, 3], 1, False),
            TrainSequence([9, 9], 1, False)]
    # stops at the one that reaches 5 tokens
    store = SequenceStore(iter(seqs), max_tokens=5, max_sequences=None)
    assert store.num_sequences == 2 and store.tokens_of(2) == 7 and store.prefix(4, None) == 1
    ids, labels, feats, start = store.get(0)  # a response: its own next tokens, no target pass needed
    assert feats is None and start == 2 and labels[2:3].tolist() == [8] and bool((labels >= 0).all())
    assert store.get(1)[1].tolist() == [-1, -1, -1]  # text: the target's argmax, computed online


def test_online_training_learns_resumes_and_loads(tiny):
    straight = train(_cfg(tiny, tiny / "on-a", features="online", steps=40, lr=1e-2, train_dtype="float32"))
    state = torch.load(tiny / "on-a" / "checkpoint" / "state.pt", weights_only=False)
    losses = [r["loss"] for r in state["history"]]
    assert straight["step"] == 40 and "extract_train" not in straight
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.3
    assert (load_draft(tiny / "on-a", ModelConfig.from_folder(tiny / "target"), torch.float32, CPU)
            .config.block_size == 4)
    assert "online" in (tiny / "on-a" / "MODEL_CARD.md").read_text()
    first = train(_cfg(tiny, tiny / "on-b", features="online", steps=40, lr=1e-2, train_dtype="float32",
                       stop_after_steps=25))
    assert first["step"] == 25
    train(_cfg(tiny, tiny / "on-b", features="online", steps=40, lr=1e-2, train_dtype="float32",
               resume=True))
    resumed = torch.load(tiny / "on-b" / "checkpoint" / "state.pt", weights_only=False)
    for name, tensor in state["draft"].items():
        assert torch.equal(tensor, resumed["draft"][name]), name


def test_steps_in_budget():
    # 20 steps took 10 s, 2 of them one evaluation: 0.4 s/step + 2 s per 10 steps -> 0.6 s/step; 30 s left,
    # less the final evaluation's 2 s -> 46 more steps
    assert steps_in_budget(20, 10.0, 2.0, 1, 10, 40.0) == 66
    assert steps_in_budget(20, 50.0, 2.0, 1, 10, 40.0) == 20  # already over: no more steps
    # the same rate after a 3 s first step (a GPU's warm-up), timed apart: 25 s left -> 41 more steps
    assert steps_in_budget(21, 13.0, 2.0, 1, 10, 40.0, first_step=3.0) == 62


def test_time_budget_fits_the_schedule_and_caps_at_steps(tiny):
    summary = train(_cfg(tiny, tiny / "budget-a", time_budget=3.0, eval_every=25, train_dtype="float32"))
    state = torch.load(tiny / "budget-a" / "checkpoint" / "state.pt", weights_only=False)
    calibration = next(r["step"] for r in state["history"] if "heldout_tau" in r)  # evaluated, then fitted
    assert 3 <= calibration <= 20 and summary["total_steps"] == state["total_steps"] > calibration
    assert summary["step"] <= summary["total_steps"]
    assert (summary["step"] == len(state["history"])
            and all(math.isfinite(r["loss"]) for r in state["history"]))
    spent = train(_cfg(tiny, tiny / "budget-b", time_budget=1e-3, steps=500, train_dtype="float32"))
    assert spent["step"] == spent["total_steps"] == 3  # the budget is gone at the first calibration point
    capped = train(_cfg(tiny, tiny / "budget-c", time_budget=600.0, steps=30, train_dtype="float32"))
    assert capped["step"] == capped["total_steps"] == 30
    with pytest.raises(BlockspecError, match="time_budget="):
        _cfg(tiny, tiny / "budget-d", time_budget=0)
    with pytest.raises(BlockspecError, match="features="):
        _cfg(tiny, tiny / "budget-e", features="ram")
