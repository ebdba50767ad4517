#!/usr/bin/env bash
# Build the one-file binary for aarch64 (a Raspberry Pi 3/4/5 with 64-bit Raspberry Pi OS, or any
# arm64 Debian 12) on an x86_64 Debian/Ubuntu machine, without Docker: an arm64 Debian 12 root made
# with debootstrap, entered with chroot, its programs run by qemu-user-static through binfmt_misc.
# Inside it, packaging/build.sh runs unchanged (python3 + venv + pip install .[build] + PyInstaller).
#
#   sudo apt-get install -y debootstrap qemu-user-static binfmt-support
#   sudo packaging/build-arm64.sh                 # writes dist-arm64/alp-gateway
#   QEMU_LD_PREFIX=dist-arm64/sysroot ALP_GATEWAY_BINARY=dist-arm64/alp-gateway \
#       pytest tests/e2e/test_binary.py              # runs it here under qemu (its glibc in sysroot)
#
# Root is needed (debootstrap, chroot, mounts). Environment:
#   ARM64_ROOT   the arm64 root to use; kept and reused when it was made here before (the first
#                run spends most of its time in debootstrap's second stage under emulation).
#                Default: a new directory from mktemp -d, removed at the end unless KEEP_ROOT=1.
#   DEBIAN_MIRROR  the Debian mirror debootstrap fetches from; default: this machine's own apt
#                source (packaging/debian-mirror.sh reads /etc/apt/sources.list[.d])
#
# Slow: every arm64 instruction is emulated. Measured on a 2-core x86_64 (packaging/DEPLOY.md):
# see "aarch64 binary" there. Not for CI.
set -euo pipefail
ROOT_DIR="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT_DIR/dist-arm64"
step() { printf '\n== build-arm64: %s (%s)\n' "$*" "$(date +%T)"; }

[ "$(id -u)" = 0 ] || { echo "build-arm64.sh: run as root (debootstrap, chroot)" >&2; exit 2; }
for tool in debootstrap chroot update-binfmts; do
    command -v "$tool" >/dev/null || { echo "build-arm64.sh: $tool missing: apt-get install -y debootstrap qemu-user-static binfmt-support" >&2; exit 2; }
done
[ -e /usr/libexec/qemu-binfmt/aarch64-binfmt-P ] || [ -e /usr/bin/qemu-aarch64-static ] \
    || { echo "build-arm64.sh: qemu-user-static missing" >&2; exit 2; }

step "binfmt_misc: qemu-aarch64"
if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
fi
update-binfmts --enable qemu-aarch64 2>/dev/null || true
grep -q enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 \
    || { echo "build-arm64.sh: binfmt entry qemu-aarch64 not enabled" >&2; exit 2; }
# Flag F (fix binary): the kernel holds the interpreter open, so it needs no copy in the chroot.
grep -q '^flags:.*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 \
    || echo "build-arm64.sh: warning: qemu-aarch64 lacks the F flag; chroot may not find qemu" >&2

made_root=0
if [ -z "${ARM64_ROOT:-}" ]; then
    ARM64_ROOT="$(mktemp -d)"
    made_root=1
fi
mounted=()
cleanup() {
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null || true; done
    if [ "$made_root" = 1 ] && [ "${KEEP_ROOT:-0}" != 1 ]; then rm -rf --one-file-system "$ARM64_ROOT"; fi
}
trap cleanup EXIT

t0=$(date +%s)
if [ ! -e "$ARM64_ROOT/.alp-arm64-ready" ]; then
    MIRROR="$("$ROOT_DIR/packaging/debian-mirror.sh" bookworm)" || exit 2
    step "debootstrap --arch=arm64 --foreign bookworm into $ARM64_ROOT from $MIRROR"
    # python3-venv and pip for the build venv; libpython3.11 is the shared libpython PyInstaller
    # bundles; binutils gives it objdump and strip; ca-certificates for pip over https.
    debootstrap --arch=arm64 --foreign --variant=minbase \
        --include=python3,python3-venv,python3-pip,libpython3.11,binutils,ca-certificates \
        bookworm "$ARM64_ROOT" "$MIRROR"
    step "debootstrap second stage (under qemu)"
    chroot "$ARM64_ROOT" /debootstrap/debootstrap --second-stage
    touch "$ARM64_ROOT/.alp-arm64-ready"
else
    step "reusing the arm64 root $ARM64_ROOT"
fi
t1=$(date +%s)

step "mounts and sources"
mount -t proc proc "$ARM64_ROOT/proc" && mounted+=("$ARM64_ROOT/proc")
mount --bind /dev "$ARM64_ROOT/dev" && mounted+=("$ARM64_ROOT/dev")
cp /etc/resolv.conf "$ARM64_ROOT/etc/resolv.conf"
# The host's trust store, so pip inside trusts what the host trusts (a proxy's CA, for one).
cp /etc/ssl/certs/ca-certificates.crt "$ARM64_ROOT/etc/ssl/certs/ca-certificates.crt"
rm -rf "$ARM64_ROOT/src" && mkdir -p "$ARM64_ROOT/src"
(cd "$ROOT_DIR" && tar -c pyproject.toml README.md gateway packaging) | tar -C "$ARM64_ROOT/src" -x
find "$ARM64_ROOT/src" -name __pycache__ -prune -exec rm -rf {} +

step "packaging/build.sh inside the arm64 root (pip + PyInstaller under qemu)"
chroot "$ARM64_ROOT" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_DEFAULT_TIMEOUT=180 ALP_BUILD_VENV=/opt/build-venv \
    /bin/bash /src/packaging/build.sh
t2=$(date +%s)

mkdir -p "$OUT"
install -m 0755 "$ARM64_ROOT/src/dist/alp-gateway" "$OUT/alp-gateway"
# To run the arm64 binary here (qemu through binfmt), qemu needs what the binary does not carry:
# the arm64 dynamic loader, glibc and zlib (PyInstaller's bootloader links libz.so.1).
# dist-arm64/sysroot gets the libraries of libc6 and zlib1g from the root, nothing else (no
# /etc: the binary still sees this machine's CA certificates and files).
# Use: QEMU_LD_PREFIX=dist-arm64/sysroot dist-arm64/alp-gateway --version
rm -rf "$OUT/sysroot"
cat "$ARM64_ROOT/var/lib/dpkg/info/libc6:arm64.list" "$ARM64_ROOT/var/lib/dpkg/info/zlib1g:arm64.list" \
    | grep -E '^/(usr/)?lib/' | while read -r f; do
    if [ -f "$ARM64_ROOT$f" ] || [ -L "$ARM64_ROOT$f" ]; then
        mkdir -p "$OUT/sysroot$(dirname "$f")" && cp -a "$ARM64_ROOT$f" "$OUT/sysroot$f"
    fi
done
# bookworm is merged-/usr: /lib is a link to usr/lib
[ -L "$ARM64_ROOT/lib" ] && [ ! -e "$OUT/sysroot/lib" ] && ln -s usr/lib "$OUT/sysroot/lib"
step "done"
file "$OUT/alp-gateway" 2>/dev/null || true
QEMU_LD_PREFIX="$OUT/sysroot" "$OUT/alp-gateway" --version
echo "build-arm64.sh: $OUT/alp-gateway, $(stat -c %s "$OUT/alp-gateway") bytes;" \
    "root $((t1 - t0)) s, build $((t2 - t1)) s, total $((t2 - t0)) s"
