#!/usr/bin/env bash
# The quick start: installs what the build and the lab need (Debian packages, only those
# missing), builds nodeport, and runs `nodeport lab`. Run it as yourself with sudo available,
# or as root:
#
#   bash scripts/quickstart.sh [LAB FLAGS...]     e.g. --proxy-mode iptables, --keep
#   bash scripts/quickstart.sh --list-tools       prints "<group> <command> <package>" per tool
#
# As a normal user, packages are installed and the lab is run through sudo; the build runs as
# you, with your own cargo. Nothing else needs to be preinstalled but Rust (rustup.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/packages.sh

if [ "${1:-}" = "--list-tools" ]; then
  nodeport_commands build lab
  exit 0
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "quickstart: cargo is not on PATH; install Rust (https://rustup.rs) and run this again" >&2
  exit 1
fi
nodeport_install build lab
cargo build --release --locked -p nodeport
if [ "$(id -u)" -eq 0 ]; then
  exec "${CARGO_TARGET_DIR:-target}/release/nodeport" lab "$@"
fi
# The lab needs root. PATH is kept so that root finds the same tools (kubectl may be the
# user's own) that the install step found.
exec sudo env "PATH=$PATH" "${CARGO_TARGET_DIR:-target}/release/nodeport" lab "$@"
