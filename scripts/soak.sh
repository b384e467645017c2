#!/usr/bin/env bash
# The churn soak of issue 20 at any length: three nodes in network namespaces (nftables,
# iptables and ebpf proxies), two API servers on one etcd, random Service and EndpointSlice
# churn, checkpoints every 10 s (see crates/nodeport/tests/soak.rs). CI runs the same test for
# 60 s as part of `cargo test`; this script runs it longer and keeps its figures.
#
#   scripts/soak.sh [--duration 30m] [--rate 10] [--seed N] [--compaction 5m] [--out DIR]
#
# --compaction: the API servers' --etcd-compaction-interval (default 5m, as kube-apiserver's).
# Each server's in-memory watch history holds at most 75 s of events (and 10,000), which is
# where its RSS levels off (docs/BENCHMARKS.md, "Churn soak").
# --rate: driver steps a second (a step is one to three API writes: a Service and its slices).
#
# Prints operations done, checks passed and every mismatch with its cause; writes
# DIR/summary.txt, DIR/rss.csv and DIR/rss.png (default DIR: target/soak/<UTC time>).
# Needs root, nft, iptables, bpftool and etcd (scripts/packages.sh installs them), and
# matplotlib for the plot (installed from PyPI when missing). Exits non-zero on any mismatch,
# failed connection or failed write, or (runs over 10 minutes) RSS growth over 10 % after the
# first five minutes.
set -euo pipefail
cd "$(dirname "$0")/.."

duration=30m rate=10 seed="" compaction="" out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) duration="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --compaction) compaction="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "soak.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

case "$duration" in
  *h) seconds=$(( ${duration%h} * 3600 )) ;;
  *m) seconds=$(( ${duration%m} * 60 )) ;;
  *s) seconds=${duration%s} ;;
  *[!0-9]*|'') echo "soak.sh: --duration is N, Ns, Nm or Nh (got $duration)" >&2; exit 2 ;;
  *) seconds=$duration ;;
esac
out=${out:-target/soak/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
out=$(cd "$out" && pwd)

if ! python3 -c 'import matplotlib' >/dev/null 2>&1; then
  echo "soak.sh: installing the Python package matplotlib (for the RSS plot)" >&2
  python3 -m pip install -q matplotlib 2>/dev/null \
    || python3 -m pip install -q --break-system-packages matplotlib
fi

echo "soak.sh: $seconds s at $rate driver steps/s; load before: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores" | tee "$out/load.txt"
status=0
env NODEPORT_SOAK_SECS="$seconds" NODEPORT_SOAK_RATE="$rate" NODEPORT_SOAK_REPORT="$out" \
  ${seed:+NODEPORT_SOAK_SEED="$seed"} ${compaction:+NODEPORT_SOAK_COMPACTION="$compaction"} \
  cargo test --locked -p nodeport --test soak -- --nocapture 2>"$out/test.log" || status=$?
echo "soak.sh: load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/load.txt"
if [ -f "$out/summary.txt" ]; then
  cat "$out/summary.txt"
else
  tail -40 "$out/test.log"
fi
if [ -f "$out/rss.csv" ]; then
  python3 docs/plots/soak_rss.py "$out/rss.csv" "$out/rss.png" && echo "soak.sh: RSS plot $out/rss.png"
fi
echo "soak.sh: the test's output is in $out/test.log"
exit "$status"
