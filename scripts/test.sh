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

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked --no-fail-fast
# The Debian package: built, installed, verified and removed (a release build).
bash scripts/package.sh
