#!/usr/bin/env bash
# Builds the Debian package (cargo deb: a release build), then installs it on this machine,
# checks it, and removes it again, leaving only its configuration, which is then purged:
#   - `nodeport --version` from /usr/bin reports this commit;
#   - the binary has no debug sections, and a panic's backtrace still names file and line
#     (from the separate debug file under /usr/lib/debug/.build-id);
#   - `systemd-analyze verify` accepts both units, and the proxy's unit with the eBPF drop-in;
#   - the example KubeProxyConfiguration passes `nodeport proxy --validate`;
#   - completions and man pages are where bash, zsh, fish and man look for them;
#   - after `dpkg -r` nothing but the conffiles is left; after `dpkg -P`, nothing.
# Installing needs root (NODEPORT_SKIP_PRIVILEGED=1 builds the package and stops there).
# Refuses to touch a nodeport package that is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/packages.sh

CARGO_DEB_VERSION=3.8.0   # builds with Rust 1.95
target=${CARGO_TARGET_DIR:-target}

nodeport_install package
# (Outputs are read into variables before grep -q looks at them: under pipefail, grep -q
# leaving early would fail its pipeline with the writer's SIGPIPE.)
installed_deb=$(cargo deb --version 2>/dev/null || true)
if ! grep -qx "cargo-deb $CARGO_DEB_VERSION" <<<"$installed_deb"; then
  cargo install cargo-deb --locked --version "$CARGO_DEB_VERSION"
fi

cargo build --release --locked -p nodeport
# Completions and man pages, generated from the binary's own clap definition.
assets="$target/release/deb-assets"
rm -rf "$assets"
mkdir -p "$assets/man"
"$target/release/nodeport" completions bash >"$assets/nodeport.bash"
"$target/release/nodeport" completions zsh >"$assets/_nodeport"
"$target/release/nodeport" completions fish >"$assets/nodeport.fish"
"$target/release/nodeport" manpages "$assets/man"
gzip -9n "$assets"/man/*.1
deb=$(cargo deb -p nodeport --no-build --locked | tail -n 1)
echo "package.sh: built $deb ($(du -h "$deb" | cut -f1))"

if [ "${NODEPORT_SKIP_PRIVILEGED:-}" = 1 ]; then
  echo "package.sh: NODEPORT_SKIP_PRIVILEGED=1: not installing the package" >&2
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "package.sh: installing the package to check it needs root" >&2
  exit 1
fi
status=$(dpkg-query -W -f='${Status}' nodeport 2>/dev/null || true)
if grep -q 'installed\|config-files' <<<"$status"; then
  echo "package.sh: a nodeport package is already on this machine; not touching it" >&2
  exit 1
fi

work=$(mktemp -d)
dropin=/etc/systemd/system/nodeport-proxy.service.d
cleanup() {
  rm -f "$dropin/ebpf.conf"
  rmdir "$dropin" 2>/dev/null || true
  if dpkg-query -W nodeport >/dev/null 2>&1; then dpkg -P nodeport >/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "package.sh: FAIL: $*" >&2; exit 1; }

dpkg -i "$deb"

# The installed binary is this commit's.
/usr/bin/nodeport --version >"$work/version"
head -n 1 "$work/version" | grep -qx "nodeport $(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)" \
  || fail "nodeport --version: $(head -n 1 "$work/version")"
grep -q "git commit:  $(git rev-parse HEAD)" "$work/version" \
  || fail "nodeport --version does not name commit $(git rev-parse HEAD)"
cat "$work/version"

# No debug sections in the shipped binary; line tables in the separate debug file.
# (.debug_gdb_scripts is not debug information: a loaded section naming gdb's pretty-printers.)
sections=$(readelf -S -W /usr/bin/nodeport 2>/dev/null || true)
debug_sections=$(grep '\.debug_' <<<"$sections" | grep -v '\.debug_gdb_scripts' || true)
[ -z "$debug_sections" ] || fail "/usr/bin/nodeport carries debug sections: $debug_sections"
debug_file=$(dpkg -L nodeport | grep '^/usr/lib/debug/.build-id/.*\.debug$' || true)
[ -n "$debug_file" ] || fail "no separate debug file under /usr/lib/debug/.build-id"
sections=$(readelf -S -W "$debug_file" 2>/dev/null || true)
grep -q '\.debug_line' <<<"$sections" || fail "$debug_file has no line tables"
# A panic (stdout is /dev/full: println! fails) shows file and line in its backtrace.
set +e
RUST_BACKTRACE=1 /usr/bin/nodeport version >/dev/full 2>"$work/panic"
status=$?
set -e
[ "$status" -eq 101 ] || fail "expected a panic (exit 101) writing to /dev/full, got $status"
grep -q 'crates/nodeport/src/cmd/version.rs:[0-9]' "$work/panic" \
  || fail "the backtrace has no file and line: $(cat "$work/panic")"
echo "package.sh: a panic's backtrace names $(grep -o -m1 'crates/nodeport/src/cmd/version.rs:[0-9:]*' "$work/panic")"

# Units.
# (--man=no: the units' man: links are checked below, with or without man-db installed.)
units=(/usr/lib/systemd/system/nodeport-apiserver.service /usr/lib/systemd/system/nodeport-proxy.service)
systemd-analyze verify --man=no "${units[@]}"
mkdir -p "$dropin"
ln -s /usr/share/nodeport/systemd/nodeport-proxy-ebpf.conf "$dropin/ebpf.conf"
systemd-analyze verify --man=no /usr/lib/systemd/system/nodeport-proxy.service
rm -f "$dropin/ebpf.conf"
rmdir "$dropin"

# The example configuration is valid (with a kubeconfig of its own: the example's path is
# where an operator puts theirs).
cat >"$work/kubeconfig" <<'YAML'
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://192.0.2.10:6443"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
YAML
/usr/bin/nodeport proxy --validate --config /usr/share/doc/nodeport/examples/kube-proxy-config.yaml \
  --kubeconfig "$work/kubeconfig" --hostname-override node-a

# Completions parse; man pages are where man looks.
bash -n /usr/share/bash-completion/completions/nodeport
test -s /usr/share/zsh/vendor-completions/_nodeport || fail "no zsh completions"
test -s /usr/share/fish/vendor_completions.d/nodeport.fish || fail "no fish completions"
for page in nodeport nodeport-apiserver nodeport-proxy nodeport-lab nodeport-version; do
  gzip -t "/usr/share/man/man1/$page.1.gz" || fail "man page $page"
  if command -v man >/dev/null 2>&1; then
    man -w "$page" >/dev/null || fail "man does not find $page"
  fi
done

# Remove: only the conffiles stay. Then purge: nothing stays.
dpkg -L nodeport | sort >"$work/files"
dpkg-query -W -f='${Conffiles}\n' nodeport | awk 'NF {print $1}' | sort >"$work/conffiles"
dpkg -r nodeport
while read -r path; do
  if [ -f "$path" ] || [ -L "$path" ]; then
    grep -qxF "$path" "$work/conffiles" || fail "$path is left after dpkg -r"
  fi
done <"$work/files"
while read -r path; do
  [ -f "$path" ] || fail "conffile $path was removed by dpkg -r"
done <"$work/conffiles"
dpkg -P nodeport
while read -r path; do
  [ ! -e "$path" ] || fail "$path is left after dpkg -P"
done <"$work/conffiles"
echo "package.sh: $deb installs, verifies and removes cleanly"
