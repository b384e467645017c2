#!/usr/bin/env python3
"""Plots the RSS samples of a churn soak (rss.csv, written by the soak test when
NODEPORT_SOAK_REPORT is set; scripts/soak.sh sets it) as a PNG: one curve per proxy and API
server, megabytes against minutes, with the five-minute mark after which the 10 % growth rule
applies.

Run: python3 docs/plots/soak_rss.py REPORT_DIR/rss.csv OUT.png
Needs matplotlib (scripts/soak.sh installs it when missing). CI does not run it.
"""

import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: soak_rss.py RSS_CSV OUT_PNG")
    series = defaultdict(list)
    with open(sys.argv[1], newline="") as f:
        for row in csv.DictReader(f):
            series[row["process"]].append((float(row["seconds"]) / 60, int(row["rss_kib"]) / 1024))
    fig, ax = plt.subplots(figsize=(9, 5))
    for name in sorted(series):
        points = sorted(series[name])
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=name)
    end = max((p[0] for s in series.values() for p in s), default=0)
    if end > 5:
        ax.axvline(5, color="grey", linestyle=":", label="5 min: growth measured from here")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title("churn soak: RSS of each proxy and API server")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
