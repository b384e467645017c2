# shellcheck shell=bash
# The one list of Debian packages nodeport's scripts install, sourced by scripts/quickstart.sh,
# scripts/test.sh and scripts/package.sh. Each entry is "<group> <command> <package>": the
# package is installed when the command is not on PATH (or, for an entry naming an absolute
# path, when that file does not exist: headers and other files that are not commands).
#
# Groups:
#   build    what `cargo build` needs besides Rust
#   lab      what `nodeport lab` runs; a test (lab::preflight) checks that these are exactly
#            the commands the lab's preflight looks for, so the two cannot drift apart
#   test     what the tests need besides build and lab
#   package  what scripts/package.sh needs to build, install and verify the Debian package
#
# A new dataplane adds its build tools to `build` (e.g. "build clang-19 clang-19") and the
# commands its lab mode runs to `lab`, together with the preflight entry.
NODEPORT_PACKAGES=(
  "build cc gcc"                     # the linker rustc calls (rustup does not bring one)
  "build protoc protobuf-compiler"   # etcd-client's build script compiles etcd's .proto files
  "build clang-19 clang-19"          # crates/proxy/build.rs compiles the eBPF programs
  "build /usr/include/bpf/bpf_helpers.h libbpf-dev"  # ... with libbpf's helper headers
  "lab ip iproute2"
  "lab nft nftables"
  "lab iptables iptables"
  "lab iptables-restore iptables"
  "lab kubectl kubernetes-client"    # a kubectl already on PATH is kept
  "lab bpftool bpftool"              # the eBPF mode's lab shows its programs and maps
  "test ip6tables iptables"
  "test conntrack conntrack"
  "test etcd etcd-server"
  "test ipset ipset"
  "test curl curl"
  "test python3 python3"             # the official Kubernetes Python client's tests
  "package systemd-analyze systemd"
  "package objcopy binutils"
  "package readelf binutils"
)

# nodeport_commands GROUP...: prints "<group> <command> <package>" for each entry of the groups.
nodeport_commands() {
  local entry group
  for entry in "${NODEPORT_PACKAGES[@]}"; do
    group=${entry%% *}
    for want in "$@"; do
      [ "$group" = "$want" ] && echo "$entry"
    done
  done
  return 0
}

# nodeport_present COMMAND-OR-PATH: whether the command is on PATH, or the file exists.
nodeport_present() {
  case "$1" in
    /*) [ -e "$1" ] ;;
    *) command -v "$1" >/dev/null 2>&1 ;;
  esac
}

# nodeport_install GROUP...: installs (apt-get, as root or through sudo) the packages of the
# groups whose command is missing, then checks every command is there.
nodeport_install() {
  local group command package missing=()
  while read -r group command package; do
    nodeport_present "$command" || missing+=("$package")
  done < <(nodeport_commands "$@")
  if [ ${#missing[@]} -gt 0 ]; then
    mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
    echo "installing ${missing[*]}" >&2
    local sudo=()
    if [ "$(id -u)" -ne 0 ]; then
      if ! command -v sudo >/dev/null 2>&1; then
        echo "need root to install ${missing[*]} (apt-get): run as root, or install sudo" >&2
        return 1
      fi
      sudo=(sudo)
    fi
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  fi
  local absent=0
  while read -r group command package; do
    if ! nodeport_present "$command"; then
      echo "$command ($package) is still missing" >&2
      absent=1
    fi
  done < <(nodeport_commands "$@")
  return $absent
}
