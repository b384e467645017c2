#!/usr/bin/env python3
"""Plots docs/nft-vs-iptables.csv (written by the dataplane_compare bench) as
docs/nft-vs-iptables.png: first-connection latency and sync time against the number of
Services, nftables mode beside iptables mode.

Run from anywhere: python3 docs/plots/nft_vs_iptables.py [CSV [PNG]]
Needs matplotlib (pip install matplotlib). CI does not run it.
"""

import csv
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent
COLOURS = {"nftables": "tab:blue", "iptables-legacy": "tab:red", "iptables-nft": "tab:orange"}


def load(path):
    rows = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows.setdefault(row["mode"], []).append(row)
    for mode in rows:
        rows[mode].sort(key=lambda r: int(r["services"]))
    return rows


def main():
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else DOCS / "nft-vs-iptables.csv"
    dst = Path(sys.argv[2]) if len(sys.argv) > 2 else DOCS / "nft-vs-iptables.png"
    rows = load(src)
    fig, (lat, tail, sync) = plt.subplots(1, 3, figsize=(15, 4.4))
    for mode, points in rows.items():
        n = [int(r["services"]) for r in points]
        c = COLOURS.get(mode)
        lat.plot(n, [float(r["p50_us"]) for r in points], "o-", color=c, label=f"{mode} p50")
        tail.plot(n, [float(r["p90_us"]) for r in points], "^--", color=c, alpha=0.6,
                  label=f"{mode} p90")
        tail.plot(n, [float(r["p99_us"]) for r in points], "s-", color=c, label=f"{mode} p99")
        sync.plot(n, [float(r["full_sync_s"]) * 1e3 for r in points], "o-", color=c,
                  label=f"{mode} full sync")
        sync.plot(n, [float(r["one_change_ms"]) for r in points], "^--", color=c, alpha=0.6,
                  label=f"{mode} one change")
    first = next(iter(rows.values()))[0]
    lat.set_title(f"TCP connect via NodePort, p50 ({first['connections']} connections)")
    lat.set_ylabel("handshake time (µs)")
    tail.set_title("… the tail: p90 and p99")
    tail.set_ylabel("handshake time (µs)")
    tail.set_yscale("log")
    sync.set_title("Sync time")
    sync.set_ylabel("ms")
    sync.set_yscale("log")
    for ax in (lat, tail, sync):
        ax.set_xscale("log")
        ax.set_xlabel("Services programmed")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    lat.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
