"""Draw a latency-under-load sweep (``python -m benchmarks.serve --sweep --out sweep.json``) as one PNG: TTFT,
inter-token latency (each p50 and p99) and throughput against goodput, over the load in % of the capacity.

    python -m benchmarks.plot_latency sweep.json [-o latency.png] [--title TEXT]

matplotlib is the ``bench`` extra's (pip install -e '.[bench]'), imported here only.
"""

from __future__ import annotations

import argparse
import json
import sys


def plot(sweep: dict, out: str, title: str | None = None) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit("benchmarks/plot_latency.py needs matplotlib: pip install -e '.[bench]'")
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    loads = sweep["loads"]
    x = [100 * s["load"] for s in loads]
    fig, (ttft, itl, tput) = plt.subplots(1, 3, figsize=(15, 4.4))
    for ax, key, name in ((ttft, "ttft_ms", "TTFT"), (itl, "itl_ms", "inter-token latency")):
        ax.plot(x, [s[key]["p50"] for s in loads], "o-", label="p50")
        ax.plot(x, [s[key]["p99"] for s in loads], "s--", label="p99")
        ax.set_title(f"{name} (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    slo = sweep["slo"]
    ttft.axhline(slo["ttft_ms"], color="grey", lw=0.8, ls=":", label="SLO")
    steady = [s.get("steady_output_tok_s") for s in loads]
    if all(v is not None for v in steady):  # while requests arrive: no ramp up, no drain
        tput.plot(x, steady, "^-", label="output tok/s while arriving")
    tput.plot(x, [s["output_tok_s"] for s in loads], "o-", label="output tok/s, ramp and drain included")
    goodput = f"goodput (TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms)"
    tput.plot(x, [s["goodput_tok_s"] for s in loads], "s--", label=goodput)
    offered = [s["rate_req_s"] * sweep["mean_output_tokens"] for s in loads]
    tput.plot(x, offered, ":", color="grey", label="offered")
    tput.set_title("output tokens/s")
    tput.set_ylim(bottom=0)
    tput.grid(True, alpha=0.3)
    tput.legend()
    cap = sweep["capacity"]
    for ax in (ttft, itl, tput):
        ax.set_xlabel(f"load, % of {cap['tok_s']:,.0f} output tok/s ({cap['req_s']:.2f} req/s)")
        ax.set_xticks(x)
    fig.suptitle(title or f"{sweep['label']}: {sweep['model']}, {sweep['workload']} requests, Poisson arrivals")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("sweep", help="the JSON of benchmarks/serve.py --sweep (--out, or its last line)")
    p.add_argument("-o", "--output", default=None, help="the PNG (default: the JSON's name, .png)")
    p.add_argument("--title", default=None, help="the figure's title (default: the sweep's label, model, workload)")
    a = p.parse_args(argv)
    with open(a.sweep) as f:
        text = f.read().strip()
    sweep = json.loads(text if text.startswith("{\n") or "\n" not in text else text.splitlines()[-1])
    out = a.output or a.sweep.rsplit(".", 1)[0] + ".png"
    plot(sweep, out, a.title)
    print(out)


if __name__ == "__main__":
    main()
