"""MODEL_CARD.md written next to a trained draft: what it is, how it was trained, how well it does."""

from __future__ import annotations

from pathlib import Path

from blockspec.models.draft_config import DraftConfig
from blockspec.train.config import TrainConfig
from blockspec.train.data import HELDOUT_MODULES, DataSpec
from blockspec.train.objective import default_gamma

SOURCE_TEXT = {
    "stdlib": "CPython standard-library source (.py, test directories and held-out modules excluded), "
              "teacher-forced: labels are the target's argmax next token, kept in a block only while the "
              "text follows the target's greedy choices",
    "pydoc": "Python 3.11 documentation sources (Debian python3.11-doc .rst.txt), teacher-forced",
}


def _source(source: str) -> str:
    if source.startswith("responses:"):
        return (f"{source.split(':')[1]} on-policy greedy responses of the target to prompts built offline "
                f"(blockspec/train/prompts.py: stdlib code tasks and docstring stubs, writing, role-play, "
                f"explanations, arithmetic, extraction, specific multi-constraint requests); "
                f"labels are the responses' own next tokens")
    return SOURCE_TEXT.get(source, f"{source} (JSONL, teacher-forced)")


def _used(stats: dict, source: str) -> str:
    used = stats.get("sources", {}).get(source)
    return f" ({used['sequences']} sequences, {used['tokens']} tokens used)" if used else ""


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _selector_table(cfg: TrainConfig, evals: list[dict]) -> list[str]:
    """A DFlash2 draft's selector figures per evaluation: the walk's tau is what the engine gets."""
    return ["", f"DFlash2: loss = DFlash loss on the unary scores + {cfg.selector_alpha:g} x the selector's "
            f"K-way cross-entropy (teacher-forced predecessor, the label swapped into the candidates when "
            f"missing); the selector's learning rate {cfg.selector_lr_scale:g} x {cfg.lr}. Held-out: the "
            f"selector walk's tau (greedy, each step after the walk's own choice: the engine's proposal) "
            f"next to the unary argmax's tau above, recall@K (the label among the unary top-K) and the "
            f"teacher-forced selector accuracy.", "",
            "| step | selector loss | walk tau | unary tau | recall@K | selector acc |",
            "|---|---|---|---|---|---|",
            *[f"| {r['step']} | {_fmt(r.get('sel_loss', '-'))} | {_fmt(r.get('heldout_walk_tau', '-'))} | "
              f"{_fmt(r['heldout_tau'])} | {_fmt(r.get('heldout_recall_at_k', '-'))} | "
              f"{_fmt(r.get('heldout_selector_acc', '-'))} |" for r in evals]]


def write_model_card(path: Path, cfg: TrainConfig, draft: DraftConfig, target: Path, spec: DataSpec,
                     stats: dict) -> None:
    history = stats.get("history", [])
    evals = [r for r in history if "heldout_tau" in r]
    last = evals[-1] if evals else {}
    d2 = draft.dflash2
    lines = [
        f"# {'DFlash2' if d2 else 'DFlash'} draft for `{target.name}`", "",
        "A block-diffusion speculative-decoding draft (z-lab checkpoint format) trained with "
        "`blockspec train-draft`. Use it with:", "",
        "```", f"blockspec generate{'' if cfg.target == 'default' else f' --model-path {target}'} "
        f"--draft-model-path {cfg.output}", "```", "",
        "## Architecture", "",
        f"- {draft.num_hidden_layers} draft layer(s), hidden {draft.hidden_size}, "
        f"{draft.num_attention_heads} heads / {draft.num_key_value_heads} KV heads, "
        f"head_dim {draft.head_dim}, intermediate {draft.intermediate_size}",
        f"- block size {draft.block_size}; target features from layers {list(draft.target_layer_ids)} "
        f"(HF hidden_states[id + 1]); mask token id {draft.mask_token_id}"
        + (f" (`{draft.mask_token}`)" if draft.mask_token else ""),
        *([f"- DFlash2: a causal convolution ({d2.conv_kernel_size} taps, groups of {d2.conv_group_size} "
           f"channels) around each layer's attention and MLP, and a candidate selector of rank "
           f"{d2.selector_rank} over the unary top-{d2.selector_top_k} (output multiplier "
           f"{d2.output_multiplier:g}, softcap {d2.final_logit_softcapping}); the engine proposes the "
           f"selector's greedy walk"] if d2 else []),
        "- shares the target's frozen embedding and LM head; initialised from "
        + {"target": "the target's top layers",
           "random": "random weights"}.get(cfg.init, f"the draft `{cfg.init}`"),
        "",
        "## Training", "",
        "```", cfg.command or "(called from Python)", "```", "",
        *[f"- data: {_source(s)}{_used(stats, s)}" for s in spec.sources],
        f"- {stats.get('train_sequences')} training sequences, {stats.get('train_tokens')} tokens "
        f"(sequence length <= {cfg.seq_len}); held-out: {stats.get('eval_sequences')} sequences from the "
        f"{', '.join(HELDOUT_MODULES)} modules / docs and held-out prompt topics (never trained on). "
        f"No benchmark prompts (HumanEval, MT-Bench) or their answers were used.",
        f"- {stats.get('step')} of {stats.get('total_steps')} steps, batch {cfg.batch_size} sequences x "
        f"{cfg.anchors_per_seq} random anchors; AdamW lr {cfg.lr}, cosine schedule, warm-up ratio "
        f"{cfg.warmup_ratio}, grad clip {cfg.grad_clip}; loss decay gamma "
        f"{cfg.loss_gamma or default_gamma(draft.block_size)}"
        + (f"; soft labels: loss = {1 - cfg.distill:g} x CE + "
           f"{cfg.distill:g} x KL(target || draft), the target's "
           + ("distribution from its own forward pass" if stats.get("features") == "online" else
              f"distribution computed from the cached features of its layer {max(draft.target_layer_ids)} "
              f"through its remaining layers") if cfg.distill else ""),
        "- target features: " + ("computed by the target for each batch (`--features online`)"
                                  if stats.get("features") == "online"
                                  else "extracted once and cached on disk"),
        f"- machine: {stats.get('machine')}; draft forward in {stats.get('train_dtype')}",
    ]
    if "train_vocab" in stats:
        v = stats["train_vocab"]
        lines.append(f"- training softmax over the {v['size']} most frequent label tokens "
                     f"({100 * v['label_coverage']:.2f}% of the labels; the rest skipped), "
                     f"saved as the draft's vocabulary (`draft_vocab`): inference and the held-out tau "
                     f"rank proposals over those tokens only")
    for key, label in (("extract_train", "feature extraction"), ("train", "training")):
        if key in stats:
            s = stats[key]
            lines.append(f"- {label}: {s.get('tokens', s.get('sequence_tokens'))} tokens in "
                         f"{s['seconds']:.0f} s ({s['tokens_per_s']:.0f} tokens/s) in the last invocation")
    lines += ["", "## Held-out acceptance", "",
              f"Estimated tau (mean accepted tokens per verify step, greedy, including the bonus token): "
              f"**{_fmt(last.get('heldout_tau', float('nan')))}** at step {last.get('step', '-')} over "
              f"{last.get('heldout_blocks', 0)} sampled blocks. It counts the leading block slots where the "
              f"draft's argmax equals the label: exact greedy acceptance on the held-out on-policy "
              f"responses (used whenever the data has responses); on teacher-forced text only a lower "
              f"bound (a run stops where the text leaves the target's greedy path). `blockspec bench` "
              f"measures the real thing.",
              "", "| step | train loss | acc@1 | held-out tau |", "|---|---|---|---|"]
    lines += [f"| {r['step']} | {_fmt(r['loss'])} | {_fmt(r['acc1'])} | {_fmt(r['heldout_tau'])} |"
              for r in evals]
    if d2:
        lines += _selector_table(cfg, evals)
    path.write_text("\n".join(lines) + "\n")
