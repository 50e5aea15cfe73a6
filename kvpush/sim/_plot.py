"""``--plot``: TTFT and TPOT against QPS, one column per input length."""

from __future__ import annotations

from ._run import Row

__all__ = ("plot",)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r.input_tokens for r in rows})
    modes = list(dict.fromkeys(r.mode for r in rows))
    fig, axes = plt.subplots(
        2, len(lengths), figsize=(4 * len(lengths), 6), squeeze=False, sharex=True
    )
    for col, n in enumerate(lengths):
        for metric, row_i, label in (
            ("ttft_ms_mean", 0, "TTFT (ms)"),
            ("tpot_ms_mean", 1, "TPOT (ms)"),
        ):
            ax = axes[row_i][col]
            for mode in modes:
                pts = sorted(
                    (r.qps, getattr(r, metric))
                    for r in rows
                    if r.mode == mode and r.input_tokens == n
                )
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if row_i == 0:
                ax.set_title(f"input {n} tokens")
            else:
                ax.set_xlabel("QPS")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
