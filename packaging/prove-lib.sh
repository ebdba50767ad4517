#!/usr/bin/env bash
# Shared by packaging/prove.sh and packaging/prove-team.sh (sourced, not run): their step
# printing, podman helpers, and the stand-in base images they build on (no container registry
# is reachable here). The caller sets PM (the podman command, an array), NICE, SCRATCH (a
# scratch directory it removes), RESULTS (an array) and failed, and is in the repository root.
#
# make_bases makes, unless already there, and names in PY and RT:
#   localhost/debian:bookworm                    a debootstrap --variant=minbase bookworm root, from
#                                                this machine's own apt source
#                                                (packaging/debian-mirror.sh; DEBIAN_MIRROR=URL)
#   localhost/python:3.11-slim-bookworm (PY)     that root with Debian's Python 3.11
#   localhost/distroless-like:base-debian12-nonroot (RT)  what distroless base-debian12:nonroot holds
# It returns 1 (after a FAIL line) when one cannot be made.

say() { printf '\n=== %s (%s)\n' "$*" "$(date +%T)"; }
ok() { RESULTS+=("PASS  $*"); printf -- '--> PASS: %s\n' "$*"; }
# shellcheck disable=SC2034  # failed: the caller's exit status
bad() { RESULTS+=("FAIL  $*"); printf -- '--> FAIL: %s\n' "$*"; failed=1; }
skip() { RESULTS+=("SKIP  $*"); printf -- '--> SKIP: %s\n' "$*"; }
quiet_wait() { while [ -e /tmp/quiet ]; do sleep 10; done; }
pm() { "${PM[@]}" "$@"; }
# Wait up to $2 s for the regex $3 in the logs of container $1. (grep -c, not -q, after a pipe:
# -q stops reading at the first match, the writer then dies of SIGPIPE, and pipefail makes the
# whole pipe false although the line was there.)
wait_log() {
    local name=$1 within=$2 pattern=$3 i
    for ((i = 0; i < within * 2; i++)); do
        pm logs "$name" 2>&1 | grep -Ec "$pattern" >/dev/null && return 0
        [ "$(pm inspect -f '{{.State.Running}}' "$name" 2>/dev/null)" = true ] || {
            pm logs "$name" 2>&1 | grep -Ec "$pattern" >/dev/null && return 0
            return 1
        }
        sleep 0.5
    done
    return 1
}

make_bases() {
    local base ctx rt deb
    if ! pm image exists localhost/debian:bookworm; then
        quiet_wait
        local MIRROR
        MIRROR="$(packaging/debian-mirror.sh bookworm)" || { bad "a Debian mirror for debootstrap"; return 1; }
        echo "    debootstrap bookworm from $MIRROR"
        base="$(mktemp -d)"
        "${NICE[@]}" debootstrap --variant=minbase bookworm "$base" "$MIRROR" >"$SCRATCH/debootstrap.log" 2>&1 \
            || { tail -5 "$SCRATCH/debootstrap.log"; bad "debootstrap"; return 1; }
        # mktemp -d made it 0700, and tar keeps that for the image's "/": uid 65532 could then reach
        # nothing ("stat /usr/local/bin/alp-gateway: permission denied"). A real base has 0755.
        chmod 0755 "$base"
        tar -C "$base" -c . | pm import - localhost/debian:bookworm >/dev/null
        rm -rf --one-file-system "$base"
    fi
    ctx="$SCRATCH/ctx" && mkdir -p "$ctx"
    cp /etc/ssl/certs/ca-certificates.crt "$ctx/ca.crt"
    cat >"$ctx/py" <<'EOF'
FROM localhost/debian:bookworm
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    libpython3.11 ca-certificates && rm -rf /var/lib/apt/lists/* && ln -s /usr/bin/python3 /usr/local/bin/python
COPY ca.crt /etc/ssl/certs/ca-certificates.crt
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt
EOF
    PY=localhost/python:3.11-slim-bookworm
    if ! pm image exists "$PY"; then
        quiet_wait
        "${NICE[@]}" "${PM[@]}" build -q --network host -f "$ctx/py" -t "$PY" "$ctx" >"$SCRATCH/base-py.log" 2>&1 \
            || { tail -5 "$SCRATCH/base-py.log"; bad "stand-in base $PY"; return 1; }
    fi
    # The runtime stand-in: what gcr.io/distroless/base-debian12:nonroot holds and nothing more
    # (GoogleContainerTools/distroless base/config.bzl: libc6 and libssl3 on the static image's
    # base-files, netbase, tzdata, CA certificates, passwd with nonroot 65532, /tmp 1777), so that a
    # library the binary needs and distroless lacks shows here. (A minbase Debian, as first
    # used, has zlib and much more: it hid that the binary's launcher needs libz.so.1.)
    RT=localhost/distroless-like:base-debian12-nonroot
    if ! pm image exists "$RT"; then
        rt="$(mktemp -d)" && chmod 0755 "$rt"
        (cd "$SCRATCH" && apt-get download -q base-files netbase tzdata libc6 libssl3 >"$SCRATCH/download.log" 2>&1) \
            || { tail -5 "$SCRATCH/download.log"; bad "apt-get download for the distroless stand-in"; return 1; }
        for deb in "$SCRATCH"/*.deb; do dpkg -x "$deb" "$rt"; done
        rm -f "$SCRATCH"/*.deb
        install -D -m 0644 /etc/ssl/certs/ca-certificates.crt "$rt/etc/ssl/certs/ca-certificates.crt"
        printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$rt/etc/passwd"
        printf 'root:x:0:\nnobody:x:65534:\ntty:x:5:\nstaff:x:50:\nnonroot:x:65532:\n' >"$rt/etc/group"
        install -d -m 1777 "$rt/tmp" && install -d -m 0700 -o 65532 -g 65532 "$rt/home/nonroot"
        tar -C "$rt" -c . | pm import -c 'USER 65532' -c 'WORKDIR /home/nonroot' \
            -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
            - "$RT" >/dev/null
        rm -rf --one-file-system "$rt"
    fi
}
