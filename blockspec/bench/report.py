"""Turning timed samples into the bench report: its JSON fields and the printed summary table (plot.py draws
it; machine.py records where it ran).

Statistics (paired: a prompt turn counts only when every method produced >= 2 tokens on it):
- tokens_per_s = 1 / mean TPOT (as the DFlash paper reports it); tokens_per_s_median = 1 / median TPOT.
- speedup = mean baseline TPOT / mean DFlash TPOT (the paper's); speedup_median = median over prompt
  turns of the per-turn ratio.
- mean_accept_length (tau) = accepted tokens per verify step, bonus included, pooled over all steps;
  mean_accept_length_prompt_avg = the mean of each turn's own tau (z-lab's benchmark averages this way).
- accept_length_histogram[k-1] = fraction of verify steps that committed k tokens, k = 1..block_size.
- num_plain_steps / speculative_step_fraction: with adaptive speculation (the default) a DFlash run may
  take plain steps where speculating does not pay; tau then covers the DFlash steps it chose to take
  (biased upwards: it speculates where acceptance is high). `--no-adaptive-speculation` measures the
  draft on every step.
- num_lookup_steps / lookup_mean_accept_length / lookup_accept_length_histogram: prompt-lookup steps
  (spec/lookup.py: a continuation copied from the context, verified like a draft block, no draft pass),
  kept out of tau and the histogram so tau stays the draft's own; tokens_per_step = committed tokens over
  all steps of the run (DFlash, prompt-lookup, merged and plain).
- num_merged_steps / merged_mean_accept_length: steps that verified a copy and the draft's candidates as
  one tree (spec/merge.py), kept out of tau as well.
- outputs_match (greedy only) = fraction of turns whose DFlash tokens equal our plain decoding's.
"""

from __future__ import annotations

import statistics
import sys
from typing import TextIO

from blockspec.bench.runner import PEERS, Sample, first_difference
from blockspec.engine.stats import RequestStats


def _paired(samples: list[Sample], names: list[str]) -> list[Sample]:
    return [s for s in samples if all(s.runs[n].tpot_s is not None for n in names)]


def method_summary(samples: list[Sample], name: str) -> dict:
    tpots = [s.runs[name].tpot_s for s in samples]
    if not tpots:
        return {"tokens_per_s": None, "tokens_per_s_median": None, "tpot_ms_mean": None,
                "tpot_ms_median": None}
    mean, median = statistics.fmean(tpots), statistics.median(tpots)
    return {
        "tokens_per_s": round(1 / mean, 3), "tokens_per_s_median": round(1 / median, 3),
        "tpot_ms_mean": round(mean * 1e3, 3), "tpot_ms_median": round(median * 1e3, 3),
        "ttft_s_mean": round(statistics.fmean(s.runs[name].time_to_first_token_s for s in samples), 4),
        "num_output_tokens": (tokens := sum(len(s.runs[name].token_ids) for s in samples)),
        # prefill included: all output tokens over all time from the request to its last token
        "end_to_end_tokens_per_s": round(tokens / sum(s.runs[name].time_to_first_token_s
                                                      + s.runs[name].decode_time_s for s in samples), 3),
    }


def speedups(samples: list[Sample], baseline: str, dflash: str) -> tuple[float | None, float | None]:
    if not samples:
        return None, None
    base = [s.runs[baseline].tpot_s for s in samples]
    spec = [s.runs[dflash].tpot_s for s in samples]
    mean = statistics.fmean(base) / statistics.fmean(spec)
    return round(mean, 4), round(statistics.median(b / d for b, d in zip(base, spec)), 4)


def accept_stats(samples: list[Sample], dflash: str, block_size: int) -> dict:
    stats = RequestStats.pooled(s.runs[dflash].stats for s in samples)
    steps, lookups, plain = stats.accept_lengths, stats.lookup_accept_lengths, stats.plain_steps
    per_turn = [s.runs[dflash].stats.mean_accept_length for s in samples
                if s.runs[dflash].stats.accept_lengths]
    counts = [0] * block_size
    for a in steps:
        counts[min(max(a, 1), block_size) - 1] += 1
    lookup_tau, per_step = stats.lookup_mean_accept_length, stats.tokens_per_step
    merged_tau = stats.merged_mean_accept_length
    return {
        "mean_accept_length": round(stats.mean_accept_length, 4) if steps else None,
        "mean_accept_length_prompt_avg": round(statistics.fmean(per_turn), 4) if per_turn else None,
        "accept_length_histogram": ([round(c / len(steps), 5) for c in counts] if steps
                                    else [0.0] * block_size),
        "num_verify_steps": len(steps),
        "num_tree_steps": stats.tree_steps,
        "num_plain_steps": plain,
        "speculative_step_fraction": round(len(steps) / (len(steps) + plain), 4) if steps or plain else None,
        "num_lookup_steps": len(lookups),
        "lookup_mean_accept_length": round(lookup_tau, 4) if lookup_tau is not None else None,
        "lookup_accept_length_histogram": [round(lookups.count(k) / len(lookups), 5)
                                           for k in range(1, max(lookups) + 1)] if lookups else None,
        "num_merged_steps": len(stats.merged_accept_lengths),
        "merged_mean_accept_length": round(merged_tau, 4) if merged_tau is not None else None,
        "tokens_per_step": round(per_step, 4) if per_step is not None else None,
    }


def match_stats(samples: list[Sample], dflash: str, reference: str, greedy: bool) -> dict:
    """Exact-equality check of DFlash against a reference run (greedy only)."""
    if not greedy or not samples:
        return {"fraction": None, "mismatches": []}
    mismatches = []
    for s in samples:
        a, b = s.runs[dflash].token_ids, s.runs[reference].token_ids
        if a != b:
            pos, x, y = first_difference(a, b)
            mismatches.append({"index": s.index, "source_id": s.source_id, "turn": s.turn + 1,
                               "position": pos, "dflash_token": x, f"{reference}_token": y})
    return {"fraction": round(1 - len(mismatches) / len(samples), 5), "mismatches": mismatches}


def dflash_entry(samples: list[Sample], dflash: str | None, block_size: int, tree_budget: int,
                 baseline: str | None, names: list[str], greedy: bool) -> dict:
    """The report fields for one DFlash configuration (the whole report, or one row of a sweep)."""
    paired = _paired(samples, names)
    entry: dict = {"method": dflash, "block_size": block_size, "tree_budget": tree_budget}
    if dflash is None:
        entry.update(mean_accept_length=None, mean_accept_length_prompt_avg=None,
                     accept_length_histogram=None, dflash_tokens_per_s=None, speedup=None,
                     speedup_median=None, outputs_match=None)
    else:
        entry.update(accept_stats(samples, dflash, block_size))
        entry["dflash_tokens_per_s"] = method_summary(paired, dflash)["tokens_per_s"]
        entry["dflash_tokens_per_s_median"] = method_summary(paired, dflash)["tokens_per_s_median"]
        for ref in ("ar", *PEERS):
            mean, median = speedups(paired, ref, dflash) if ref in names else (None, None)
            entry[f"speedup_vs_{ref}"], entry[f"speedup_vs_{ref}_median"] = mean, median
        entry["speedup"] = entry.get(f"speedup_vs_{baseline}")
        entry["speedup_median"] = entry.get(f"speedup_vs_{baseline}_median")
        ar = (match_stats(samples, dflash, "ar", greedy) if "ar" in names
              else {"fraction": None, "mismatches": []})
        entry["outputs_match"], entry["mismatches"] = ar["fraction"], ar["mismatches"]
        for peer in PEERS:  # informational: a peer computes its own numerics
            if peer in names:
                entry[f"{peer}_outputs_match"] = match_stats(samples, dflash, peer, greedy)["fraction"]
    entry["per_prompt"] = [_prompt_row(s, dflash, baseline, names) for s in samples]
    return entry


def _ms(value: float | None) -> float | None:
    return round(value * 1e3, 3) if value is not None else None


def _prompt_row(s: Sample, dflash: str | None, baseline: str | None, names: list[str]) -> dict:
    row: dict = {"index": s.index, "source_id": s.source_id, "turn": s.turn + 1,
                 "num_prompt_tokens": s.num_prompt_tokens}
    for name in names:
        key = "dflash" if name == dflash else name
        if name.startswith("dflash") and name != dflash:
            continue
        row[f"{key}_num_output_tokens"] = len(s.runs[name].token_ids)
        row[f"{key}_tpot_ms"] = _ms(s.runs[name].tpot_s)
    if dflash is not None:
        stats = s.runs[dflash].stats
        row["mean_accept_length"] = round(stats.mean_accept_length, 4) if stats.accept_lengths else None
        row["accept_lengths"] = stats.accept_lengths
        row["plain_steps"] = stats.plain_steps
        row["lookup_accept_lengths"] = stats.lookup_accept_lengths
        base, spec = (s.runs[baseline].tpot_s if baseline else None), s.runs[dflash].tpot_s
        row["speedup"] = round(base / spec, 4) if base and spec else None
        if "ar" in names:
            row["outputs_match"] = s.runs[dflash].token_ids == s.runs["ar"].token_ids
    return row


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(report: dict, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    methods = report["methods"]
    base = report["baseline"]
    print(f"\nblockspec bench: {report['dataset']}, {report['num_prompts']} prompts "
          f"({report['num_samples']} timed turns), max_new_tokens={report['max_new_tokens']}, "
          f"temperature={report['temperature']}", file=out)
    header = (f"{'method':<16}{'tok/s':>9}{'tok/s med':>11}{'TPOT ms':>10}{'TPOT med':>10}{'speedup':>9}"
              f"{'spd med':>9}{'tau':>7}")
    print(header, file=out)
    print("-" * len(header), file=out)
    rows = report.get("sweep") or [report]
    for name, summary in methods.items():
        if name.startswith("dflash"):
            continue
        spd, spd_med = ("1.00x", "-") if name == base else ("-", "-")
        if name == "ar" and base in PEERS and report.get(f"ar_speedup_vs_{base}") is not None:
            spd = f"{report[f'ar_speedup_vs_{base}']:.2f}x"
            spd_med = f"{report[f'ar_speedup_vs_{base}_median']:.2f}x"
        print(f"{name + (' (baseline)' if name == base else ''):<16}"
              f"{_fmt(summary['tokens_per_s'], '.2f'):>9}"
              f"{_fmt(summary['tokens_per_s_median'], '.2f'):>11}{_fmt(summary['tpot_ms_mean'], '.1f'):>10}"
              f"{_fmt(summary['tpot_ms_median'], '.1f'):>10}{spd:>9}{spd_med:>9}{'-':>7}", file=out)
    for row in rows:
        if row.get("dflash_tokens_per_s") is None and row.get("mean_accept_length") is None:
            continue
        s = methods[row["method"]]
        print(f"{config_label(row):<16}{_fmt(s['tokens_per_s'], '.2f'):>9}"
              f"{_fmt(s['tokens_per_s_median'], '.2f'):>11}{_fmt(s['tpot_ms_mean'], '.1f'):>10}"
              f"{_fmt(s['tpot_ms_median'], '.1f'):>10}{_fmt(row['speedup'], '.2f') + 'x':>9}"
              f"{_fmt(row['speedup_median'], '.2f') + 'x':>9}{_fmt(row['mean_accept_length'], '.2f'):>7}",
              file=out)
        for peer, label in PEERS.items():
            if row.get(f"speedup_vs_{peer}") is not None and base != peer:
                print(f"{'':<16}vs {label}: {row[f'speedup_vs_{peer}']:.2f}x", file=out)
        if row.get("speedup_vs_ar") is not None and base in PEERS:
            print(f"{'':<16}vs our plain decoding: {row['speedup_vs_ar']:.2f}x", file=out)
        hist = " ".join(f"{k}:{f:.2f}" for k, f in enumerate(row["accept_length_histogram"], 1) if f > 0)
        print(f"{'':<16}accept-length histogram {hist}", file=out)
        if row.get("num_tree_steps"):
            print(f"{'':<16}{row['num_tree_steps']} of {row['num_verify_steps']} DFlash steps verified "
                  f"trees", file=out)
        if row.get("num_plain_steps"):
            print(f"{'':<16}adaptive speculation: {row['num_verify_steps']} DFlash steps "
                  f"(tau above is theirs), {row['num_plain_steps']} plain steps", file=out)
        if row.get("num_lookup_steps"):
            print(f"{'':<16}prompt lookup: {row['num_lookup_steps']} steps, "
                  f"tau {row['lookup_mean_accept_length']:.2f} (not in the draft's tau above); "
                  f"{row['tokens_per_step']:.2f} tokens per step overall", file=out)
        if row.get("num_merged_steps"):
            print(f"{'':<16}copy + draft as one tree: {row['num_merged_steps']} steps, "
                  f"tau {row['merged_mean_accept_length']:.2f} (not in the draft's tau above)", file=out)
        if row.get("outputs_match") is not None:
            flag = ("" if row["outputs_match"] == 1.0
                    else "   <-- LOSSLESSNESS BUG: DFlash output differs from plain decoding")
            print(f"{'':<16}outputs_match {row['outputs_match']:.3f}{flag}", file=out)
    for note in report["notes"]:
        print(f"note: {note}", file=out)
    m = report["machine"]
    print(f"machine: {m['cpu']}, {m['threads']} threads, torch {m['torch']}, {m['device']} {m['dtype']}",
          file=out)


def config_label(row: dict) -> str:
    """A DFlash configuration in the table: its block size, and its tree budget where it has one."""
    budget = row.get("tree_budget")
    return f"dflash B={row['block_size']}" + (f" N={budget}" if budget else "")


TIMING = ("decode-only: per prompt turn, time from the first output token to the last over the tokens "
          "after the first (TPOT; prefill and the draft's context injection excluded); batch 1; methods "
          "interleaved prompt by prompt in one process, their order rotating; prompt 0 run once through "
          "every method as an uncounted warm-up. transformers generate is timed the same way via a "
          "streamer (first new token -> end).")


def build_report(samples: list[Sample], names: list[str], dflash: list[tuple[str, int, int]],
                 baseline: str, greedy: bool, meta: dict) -> dict:
    """The full JSON report. `dflash` lists (method name, block size, tree budget); with several (a sweep)
    the top-level DFlash fields are those of the configuration with the best speedup, and `sweep` holds
    every one."""
    paired = _paired(samples, names)
    base = baseline if baseline != "none" else None
    summaries = {name: method_summary(paired, name) for name in names}
    entries = [dflash_entry(samples, d, size, budget, base, names, greedy) for d, size, budget in dflash] or [
        dflash_entry(samples, None, meta["block_size"], 0, base, names, greedy)]
    best = max(entries, key=lambda e: (e.get("speedup") or 0, e["block_size"]))
    report = {**meta, **best, "baseline": baseline, "num_samples": len(samples),
              "num_timed_pairs": len(paired),
              "baseline_tokens_per_s": summaries[base]["tokens_per_s"] if base else None,
              "baseline_tokens_per_s_median": summaries[base]["tokens_per_s_median"] if base else None,
              "ar_tokens_per_s": summaries["ar"]["tokens_per_s"] if "ar" in names else None,
              "methods": summaries, "timing": TIMING}
    for peer in PEERS:
        report[f"{peer}_tokens_per_s"] = summaries[peer]["tokens_per_s"] if peer in names else None
        if "ar" in names and peer in names:  # our plain decoding vs the peer's
            (report[f"ar_speedup_vs_{peer}"],
             report[f"ar_speedup_vs_{peer}_median"]) = speedups(paired, peer, "ar")
    if len(entries) > 1:
        report["sweep"] = [{k: v for k, v in e.items() if k != "per_prompt"} for e in entries]
        report["notes"] = report["notes"] + [
            f"sweep: top-level DFlash fields are {config_label(best)} (best speedup); see 'sweep' for every "
            f"configuration."]
    return report
