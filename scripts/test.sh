#!/usr/bin/env bash
# The one test command: installs what the tests need, then runs fmt, clippy and every test,
# and builds, installs, checks and removes the Debian package (scripts/package.sh).
# Network-namespace, nftables/iptables, etcd and kubectl tests are part of it; they fail,
# never skip, when a prerequisite is missing (only NODEPORT_SKIP_PRIVILEGED=1, which CI
# never sets, skips the tests that need root).
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the build, the lab and the tests use (the one list: scripts/packages.sh),
# installed when missing; root is needed only when something is missing.
source scripts/packages.sh
nodeport_install build lab test

# Python packages the tests use: the official Kubernetes client (apiserver_python.rs), from PyPI
# (Debian's python3-kubernetes is years behind). A Debian python3 is "externally managed".
if ! python3 -c 'import kubernetes' >/dev/null 2>&1; then
  echo "test.sh: installing the Python package kubernetes" >&2
  if ! python3 -m pip --version >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip
  fi
  python3 -m pip install -q kubernetes 2>/dev/null \
    || python3 -m pip install -q --break-system-packages kubernetes
  python3 -c 'import kubernetes' || { echo "test.sh: the kubernetes package is still missing" >&2; exit 1; }
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --workspace --locked --no-fail-fast 2>&1 | tee "$log"
# The Debian package: built, installed, verified and removed (a release build).
bash scripts/package.sh
# One closing line for the whole run (each test binary printed its own above).
awk '/^test result:/ {p += $4; f += $6} END {printf "tests: %d passed, %d failed\n", p, f}' "$log"
