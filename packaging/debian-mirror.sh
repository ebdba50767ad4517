#!/usr/bin/env bash
# Print the Debian mirror that debootstrap should fetch a suite from: $DEBIAN_MIRROR when it is
# set, else this machine's own apt source, so that no mirror's host is written into the scripts
# that call it (build-arm64.sh, prove.sh).
#
#   MIRROR="$(packaging/debian-mirror.sh bookworm)" || exit 2
#
# The machine's source is read from the deb822 files /etc/apt/sources.list.d/*.sources (the URIs:
# of a stanza of Types: deb) and the one-line files /etc/apt/sources.list and
# /etc/apt/sources.list.d/*.list (`deb [options] URI SUITE COMPONENTS...`). First choice: a source
# whose suites include SUITE (default bookworm). Else a source whose URI ends in /debian, the
# path of a Debian archive mirror, which carries every current suite (say, a trixie machine's).
# Disabled stanzas (Enabled: no), comments and deb-src are skipped. With neither, it exits 2 with
# one line saying to set DEBIAN_MIRROR. APT_DIR (default /etc/apt) is where it looks.
set -euo pipefail
suite="${1:-bookworm}"
if [ -n "${DEBIAN_MIRROR:-}" ]; then
    printf '%s\n' "$DEBIAN_MIRROR"
    exit 0
fi
apt_dir="${APT_DIR:-/etc/apt}"

# One "URI SUITE" line per source, in the order apt reads them.
sources() {
    local f
    for f in "$apt_dir"/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        # deb822: stanzas split by blank lines; a line starting with a blank continues the field
        # before it (a Signed-By key block, say); field names are case-insensitive.
        awk '
            function flush(    i, nu, ns, u, s) {
                if (types ~ /(^|[ \t])deb([ \t]|$)/ && tolower(enabled) != "no") {
                    nu = split(uris, u, /[ \t]+/); ns = split(suites, s, /[ \t]+/)
                    for (i = 1; i <= nu; i++) if (u[i] != "") for (j = 1; j <= ns; j++)
                        if (s[j] != "") print u[i], s[j]
                }
                types = ""; uris = ""; suites = ""; enabled = ""; field = ""
            }
            /^#/ { next }
            /^[ \t]*$/ { flush(); next }
            /^[ \t]/ { if (field == "uris") uris = uris " " $0; else if (field == "suites") suites = suites " " $0; next }
            {
                field = tolower(substr($0, 1, index($0, ":") - 1)); value = substr($0, index($0, ":") + 1)
                if (field == "types") types = value
                else if (field == "uris") uris = value
                else if (field == "suites") suites = value
                else if (field == "enabled") enabled = value
                gsub(/^[ \t]+|[ \t]+$/, "", enabled)
            }
            END { flush() }
        ' "$f"
    done
    for f in "$apt_dir/sources.list" "$apt_dir"/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        # deb [opt=v ...] URI SUITE COMPONENTS...: the options in brackets may hold blanks
        sed -e 's/#.*//' -e 's/\[[^]]*\]//' "$f" | awk '$1 == "deb" && NF >= 3 { print $2, $3 }'
    done
}

# (awk reads every line: an early exit could end `sources` with SIGPIPE, failing under pipefail)
found="$(sources | awk -v suite="$suite" '$2 == suite && !n++ { print $1 }')"
if [ -z "$found" ]; then
    found="$(sources | awk '$1 ~ /\/debian\/?$/ && !n++ { print $1 }')"
fi
if [ -z "$found" ]; then
    echo "debian-mirror.sh: no apt source of this machine serves Debian $suite (read $apt_dir/sources.list and $apt_dir/sources.list.d/): set DEBIAN_MIRROR to a Debian mirror's URL" >&2
    exit 2
fi
printf '%s\n' "${found%/}"
