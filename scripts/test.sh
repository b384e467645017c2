#!/usr/bin/env bash
# The one test command: installs what the tests need, then runs fmt, clippy and every test.
# Network-namespace, nftables/iptables, etcd and kubectl tests are part of it; they fail,
# never skip, when a prerequisite is missing (only NODEPORT_SKIP_PRIVILEGED=1, which CI
# never sets, skips the tests that need root).
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the tests use, keyed by the command that shows they are there.
declare -A packages=(
  [nft]=nftables
  [iptables]=iptables
  [ip6tables]=iptables
  [conntrack]=conntrack
  [ip]=iproute2
  [etcd]=etcd-server
  [ipset]=ipset
  [curl]=curl
  [protoc]=protobuf-compiler
  [clang-19]=clang-19
  [python3]=python3
  [bpftool]=bpftool
)
missing=()
for cmd in "${!packages[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${packages[$cmd]}")
done
# libbpf's headers build the eBPF programs (crates/proxy/build.rs).
[ -f /usr/include/bpf/bpf_helpers.h ] || missing+=(libbpf-dev)
# kubectl: the machine's own is preferred; Debian's kubernetes-client is the fallback.
command -v kubectl >/dev/null 2>&1 || missing+=(kubernetes-client)
if [ ${#missing[@]} -gt 0 ]; then
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  echo "test.sh: installing ${missing[*]}" >&2
  if [ "$(id -u)" -ne 0 ]; then
    echo "test.sh: need root to install ${missing[*]} (apt-get)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}"
fi
for cmd in "${!packages[@]}" kubectl; do
  command -v "$cmd" >/dev/null 2>&1 || { echo "test.sh: $cmd is still missing" >&2; exit 1; }
done

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
cargo test --workspace --locked --no-fail-fast
