"""`bench --plot`: the report drawn (matplotlib, the `bench` extra)."""

from __future__ import annotations


def write_plot(report: dict, path: str) -> None:
    """Acceptance-length histogram and per-prompt speedup; for a sweep, tau and speedup per block size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    if report.get("sweep"):
        rows = report["sweep"]
        trees = len({r["tree_budget"] for r in rows}) > 1
        # a tree sweep's x axis is the budget (0, the chain, drawn at 1 on the log axis)
        xs = [max(r["tree_budget"], 1) if trees else r["block_size"] for r in rows]
        names = [str(r["tree_budget"] if trees else r["block_size"]) for r in rows]
        what = f"tree budget N (B={rows[0]['block_size']}; 0: chain)" if trees else "block size B"
        left.plot(xs, [r["mean_accept_length"] for r in rows], "o-")
        left.set(xlabel=what, ylabel="tau (accepted tokens / step)", title="Acceptance length")
        speed = [r["speedup"] if r["speedup"] is not None else float("nan") for r in rows]
        right.plot(xs, speed, "o-", color="tab:green")
        right.axhline(1.0, color="grey", lw=0.8, ls="--")
        right.set(xlabel=what, ylabel=f"decode speedup vs {report['baseline']}", title="Speedup")
        for axis in (left, right):
            axis.set_xscale("log", base=2)
            axis.set_xticks(xs, names)
    else:
        hist = report["accept_length_histogram"] or []
        lookup = report.get("lookup_accept_length_histogram") or []
        shift = 0.2 if lookup else 0.0
        left.bar([k - shift for k in range(1, len(hist) + 1)], hist, width=0.8 - 2 * shift,
                 label=f"draft (tau {report['mean_accept_length'] or 0:.2f})")
        if lookup:
            left.bar([k + shift for k in range(1, len(lookup) + 1)], lookup, width=0.4, color="tab:orange",
                     label=f"prompt lookup (tau {report['lookup_mean_accept_length']:.2f})")
            left.legend()
        left.set_xticks(range(1, max(len(hist), len(lookup)) + 1))
        left.set(xlabel="accepted tokens per verify step (incl. bonus)", ylabel="fraction of steps",
                 title=f"Acceptance length (tau={report['mean_accept_length'] or 0:.2f}, "
                       f"B={report['block_size']})")
        pts = [(i, r["speedup"]) for i, r in enumerate(report["per_prompt"]) if r.get("speedup") is not None]
        right.bar([p[0] for p in pts], [p[1] for p in pts], color="tab:green")
        right.axhline(1.0, color="grey", lw=0.8, ls="--")
        if report.get("speedup") is not None:
            right.axhline(report["speedup"], color="tab:red", lw=1,
                          label=f"mean-TPOT speedup {report['speedup']:.2f}x")
            right.legend()
        right.xaxis.get_major_locator().set_params(integer=True)
        right.set(xlabel="prompt turn", ylabel=f"decode speedup vs {report['baseline']}",
                  title="Per-prompt speedup")
    fig.suptitle(f"blockspec bench: {report['dataset']}, {report['num_samples']} turns, "
                 f"{report['machine']['device']} ({report['machine']['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
