#!/usr/bin/env bash
# Prove the team recipe (packaging/team/: two hub replicas on one PostgreSQL behind HAProxy)
# where it runs: the compose file itself, run by podman-compose with podman, on one Debian 12
# machine with no container registry. Prints each step's result and a summary; exit 0 when every
# step passed. Rerunnable: images are reused, the containers, volumes and network of an earlier
# run (compose project alp-prove-team, containers alp-prove-team-*) are removed first.
#
#   sudo packaging/prove-team.sh            # from the repository root or anywhere
#
# What it proves (packaging/DEPLOY.md, "A hub for a team"):
#   1. the images compose.yaml names: the hub's built by compose from packaging/Dockerfile and
#      HAProxy's from Dockerfile.haproxy, on the stand-in bases prove.sh makes
#      (packaging/prove-lib.sh), passed in as the file's build arguments; `postgres:15` stood in
#      for by Debian's postgresql-15 on the same Debian 12 root, behind an entrypoint that does
#      what the official image's does with POSTGRES_PASSWORD/USER/DB (POSTGRES_IMAGE)
#   2. `podman-compose up`: PostgreSQL first, healthy by the file's own healthcheck (podman 4.3
#      cannot wait for service_healthy, so depends_on's condition is run here), then both
#      replicas and HAProxy on the compose network, HAProxy published on loopback
#      (ALP_TEAM_PUBLISH); the admin credential printed once, by one replica
#   3. an API key made with `hub keys create` in a replica's container
#   4. a runner (the same image, `alp-gateway run`, on the host network, its backend the
#      simulator `alp-gateway sim`) registered through HAProxy's published port; a chat turn
#      through HAProxy's front door
#   5. `hub doctor` in a replica's container: the store, its migrations, both replicas up and
#      reachable at their advertised addresses
#   6. the replica holding the runner's channel killed (podman kill, SIGKILL): the next turn
#      through HAProxy served; the runner redialled the survivor
#   7. the killed replica started again (`podman-compose up -d`): HAProxy sends requests to it;
#      then the other replica's process SIGKILLed from the host (a crash, not `podman kill`):
#      `restart: unless-stopped` brings it back, HAProxy uses it again, a turn is served
#   8. `hub usage` in a replica: the key's turns counted once each
#   9. `podman-compose down -v`: everything this script started is gone
#
# Needs root, podman, runc, debootstrap, curl, python3 (JSON), and podman-compose (on PATH, or
# PODMAN_COMPOSE=path; else it is installed from PyPI into a scratch venv for the run).
# The Debian root comes from this machine's own apt source (packaging/debian-mirror.sh, through
# packaging/prove-lib.sh); DEBIAN_MIRROR=URL names another mirror.
# Networking: the team on its compose network; on the host only 127.0.0.1: HAProxy's published
# port PROVE_TEAM_PORT (default 18790), the simulator's PROVE_TEAM_SIM_PORT (18801) and the
# runner's metrics PROVE_TEAM_METRICS_PORT (18802). Every wait is bounded.
set -uo pipefail
ROOT_DIR="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT_DIR" || exit 2
PM=(podman --storage-driver vfs --runtime runc --cgroup-manager cgroupfs)
NICE=(nice -n 19 ionice -c3)
PORT="${PROVE_TEAM_PORT:-18790}"
SIM_PORT="${PROVE_TEAM_SIM_PORT:-18801}"
METRICS_PORT="${PROVE_TEAM_METRICS_PORT:-18802}"
PROJ=alp-prove-team   # the compose project: its containers, volumes and network
P=alp-prove-team      # prefix of the containers started here outside compose
IMG=localhost/alp-gateway:team-prove
PG_IMG=localhost/postgresql-like:15
FILE=packaging/team/compose.yaml
SCRATCH="$(mktemp -d)"
declare -a RESULTS=()
ADMIN="" KEY="" up=0
failed=0
# shellcheck source=packaging/prove-lib.sh
. "$ROOT_DIR/packaging/prove-lib.sh"

[ "$(id -u)" = 0 ] || { echo "prove-team.sh: run as root" >&2; exit 2; }
for tool in podman runc debootstrap curl python3; do
    command -v "$tool" >/dev/null || { echo "prove-team.sh: $tool missing (apt-get install -y podman runc debootstrap curl)" >&2; exit 2; }
done
# podman-compose calls plain `podman`: give it (and every podman here) prove.sh's storage, runtime
# and cgroup manager through its configuration files, for this run only
printf '[storage]\ndriver = "vfs"\nrunroot = "/run/containers/storage"\ngraphroot = "/var/lib/containers/storage"\n' >"$SCRATCH/storage.conf"
# podman's default ulimits cannot be set in some sandboxes (a container without CAP_SYS_RESOURCE)
printf '[containers]\ndefault_ulimits = []\n[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n' >"$SCRATCH/containers.conf"
export CONTAINERS_STORAGE_CONF="$SCRATCH/storage.conf" CONTAINERS_CONF="$SCRATCH/containers.conf"
PC="${PODMAN_COMPOSE:-$(command -v podman-compose)}"
if [ -z "$PC" ]; then
    echo "prove-team.sh: podman-compose not found: installing it from PyPI into a scratch venv"
    python3 -m venv "$SCRATCH/venv" && "$SCRATCH/venv/bin/pip" install -q podman-compose >"$SCRATCH/pip.log" 2>&1 \
        || { tail -5 "$SCRATCH/pip.log"; echo "prove-team.sh: pip install podman-compose failed" >&2; exit 2; }
    PC="$SCRATCH/venv/bin/podman-compose"
fi
# compose runs from the repository root with the file's own relative paths; --podman-build-args:
# the builds' RUN steps on the host network, as prove.sh's (how the build reaches apt and PyPI is
# not the recipe's business)
compose() { "${NICE[@]}" "$PC" -p "$PROJ" -f "$FILE" --podman-build-args "--network host" "$@"; }
# The container of a compose service (podman-compose names them PROJECT_SERVICE_1)
cname() { pm ps -a --filter "label=io.podman.compose.project=$PROJ" --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | head -1; }
remove_all() {
    local ids
    ids="$(pm ps -aq --filter "label=io.podman.compose.project=$PROJ")"
    # shellcheck disable=SC2086
    [ -n "$ids" ] && pm rm -f -v -t 0 $ids >/dev/null 2>&1
    for c in "$P-runner" "$P-sim"; do pm rm -f -v -t 0 "$c" >/dev/null 2>&1; done
    for v in $(pm volume ls -q --filter "label=io.podman.compose.project=$PROJ"); do pm volume rm -f "$v" >/dev/null 2>&1; done
    pm pod rm -f "pod_$PROJ" >/dev/null 2>&1
    pm network rm -f "${PROJ}_default" >/dev/null 2>&1
}
cleanup() {
    remove_all
    rm -rf "$SCRATCH"
}
trap cleanup EXIT

echo "prove-team.sh: $(date -u '+%F %T UTC'), $(uname -m), $(nproc) cores, $(. /etc/os-release; echo "$PRETTY_NAME"), $(podman --version), $("$PC" --version 2>/dev/null | grep -i compose | head -1), commit $(git -C "$ROOT_DIR" rev-parse --short HEAD 2>/dev/null)"
T_START=$(date +%s)
remove_all

# The variables compose.yaml reads (its header): the stand-ins, the port on loopback, the
# secrets' file, made from team.env.example with a fresh password, mode 600, outside the checkout
PASSWORD="$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
sed -e "s|change-me|$PASSWORD|g" \
    -e "s|^ALP_GATEWAY_HUB_TEAM_SECRET=.*|ALP_GATEWAY_HUB_TEAM_SECRET=$(python3 -c 'import secrets; print(secrets.token_hex(32))')|" \
    packaging/team/team.env.example >"$SCRATCH/team.env"
chmod 600 "$SCRATCH/team.env"
export ALP_TEAM_ENV_FILE="$SCRATCH/team.env" ALP_TEAM_PUBLISH="127.0.0.1:$PORT" ALP_GATEWAY_IMAGE="$IMG" \
    POSTGRES_IMAGE="$PG_IMG" DEBIAN_IMAGE=localhost/debian:bookworm
TEAM="http://127.0.0.1:$PORT"

# ---------------------------------------------------------------------------------------------
say "1. the images compose.yaml names, on stand-in bases"
make_bases || exit 1
export PYTHON_IMAGE="$PY" RUNTIME_IMAGE="$RT"
# postgres:15 stood in for: Debian 12's postgresql-15, and an entrypoint doing what the official
# image's does on an empty data directory (initdb as POSTGRES_USER with POSTGRES_PASSWORD, host
# connections by scram-sha-256, POSTGRES_DB made), then the server as user postgres
pgctx="$SCRATCH/pg" && mkdir -p "$pgctx"
cat >"$pgctx/Dockerfile" <<'EOF'
FROM localhost/debian:bookworm
RUN apt-get update && apt-get install -y --no-install-recommends postgresql-15 \
    && pg_dropcluster 15 main && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PGDATA=/var/lib/postgresql/data
COPY entrypoint.sh /usr/local/bin/docker-entrypoint.sh
VOLUME ["/var/lib/postgresql/data"]
STOPSIGNAL SIGINT
EXPOSE 5432
ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]
CMD ["postgres"]
EOF
cat >"$pgctx/entrypoint.sh" <<'EOF'
#!/bin/sh
set -eu
if [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA" /var/run/postgresql
    chown postgres:postgres "$PGDATA" /var/run/postgresql
    chmod 0700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is not set}"
    user="${POSTGRES_USER:-postgres}"
    pw="$(mktemp)" && printf '%s\n' "$POSTGRES_PASSWORD" >"$pw"
    initdb -D "$PGDATA" -U "$user" --pwfile="$pw" -E UTF8 --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pw"
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    echo "listen_addresses = '*'" >>"$PGDATA/postgresql.conf"
    if [ "${POSTGRES_DB:-$user}" != postgres ]; then
        pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
        createdb -U "$user" "${POSTGRES_DB:-$user}"
        pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    fi
    echo "initialised $PGDATA for $user"
fi
exec "$@"
EOF
chmod 0755 "$pgctx/entrypoint.sh"
if ! pm image exists "$PG_IMG"; then
    quiet_wait
    t0=$(date +%s)
    "${NICE[@]}" "${PM[@]}" build -q --network host -f "$pgctx/Dockerfile" -t "$PG_IMG" "$pgctx" >"$SCRATCH/pg.log" 2>&1 \
        || { tail -5 "$SCRATCH/pg.log"; bad "stand-in $PG_IMG"; exit 1; }
    echo "    $PG_IMG built in $(($(date +%s) - t0)) s"
fi
ok "stand-in for postgres:15: $PG_IMG ($(pm run --rm --entrypoint postgres "$PG_IMG" --version))"
quiet_wait
t0=$(date +%s)
old_ids="$(pm image inspect -f '{{.Id}}' "$IMG" "${PROJ}_haproxy" 2>/dev/null)"
# hub-b's build is hub-a's (the same YAML anchor, the same image name): built once
if compose build hub-a haproxy >"$SCRATCH/build.log" 2>&1; then
    # the images this script built before, now untagged: removed (vfs copies every layer)
    for id in $old_ids; do
        pm image inspect -f '{{.Id}}' "$IMG" "${PROJ}_haproxy" 2>/dev/null | grep -cx "$id" >/dev/null || pm rmi "$id" >/dev/null 2>&1
    done
    ok "compose build (hub-a, hence hub-b: $IMG from packaging/Dockerfile; haproxy from Dockerfile.haproxy) in $(($(date +%s) - t0)) s: $(pm run --rm "$IMG" --version); $(pm run --rm --entrypoint /usr/sbin/haproxy "${PROJ}_haproxy" -v 2>&1 | head -1)"
else
    tail -20 "$SCRATCH/build.log"
    bad "compose build"
    exit 1
fi

# ---------------------------------------------------------------------------------------------
say "2. podman-compose up: PostgreSQL, then two replicas and HAProxy"
compose config >"$SCRATCH/config.yaml" 2>"$SCRATCH/config.err" \
    && grep -q "image: $PG_IMG" "$SCRATCH/config.yaml" && grep -q "127.0.0.1:$PORT:8787" "$SCRATCH/config.yaml" \
    && ok "compose config: the file's variables interpolated (postgres image $PG_IMG, HAProxy on 127.0.0.1:$PORT)" \
    || { cat "$SCRATCH/config.err"; bad "compose config"; }
t0=$(date +%s)
compose up -d postgres >"$SCRATCH/up-pg.log" 2>&1 || { tail -10 "$SCRATCH/up-pg.log"; bad "compose up -d postgres"; }
PG="$(cname postgres)"
healthy=0
for ((i = 0; i < 120; i++)); do   # the file's own healthcheck (pg_isready), what depends_on waits for
    pm healthcheck run "$PG" >/dev/null 2>&1 && { healthy=1; break; }
    sleep 0.5
done
if [ "$healthy" = 1 ]; then
    ok "postgres ($PG) healthy by the file's healthcheck in $(($(date +%s) - t0)) s: $(pm logs "$PG" 2>&1 | grep -m1 initialised)"
else
    pm logs "$PG" 2>&1 | tail -10 | sed 's/^/    pg: /'
    bad "postgres not healthy within 60 s"
fi
t0=$(date +%s)
if compose up -d >"$SCRATCH/up.log" 2>&1; then
    grep -i -E "warn|ignored" "$SCRATCH/up.log" | sed 's/^/    compose: /' | head -5
else
    tail -10 "$SCRATCH/up.log"
    bad "compose up -d"
fi
A="$(cname hub-a)" B="$(cname hub-b)" H="$(cname haproxy)"
if wait_log "$A" 90 'hub listening on' && wait_log "$B" 90 'hub listening on'; then
    for c in "$A" "$B"; do pm logs "$c" 2>&1 | grep -v -A1 '^admin token' | grep -v '^  ' | head -6 | cut -c1-220 | sed "s/^/    $c: /"; done
    ADMIN="$(pm logs "$A" 2>&1 | grep -A1 '^admin token' | tail -1 | tr -d ' \r')"
    [ -n "$ADMIN" ] || ADMIN="$(pm logs "$B" 2>&1 | grep -A1 '^admin token' | tail -1 | tr -d ' \r')"
    printed="$( (pm logs "$A"; pm logs "$B") 2>&1 | grep -c '^admin token')"
    [ -n "$ADMIN" ] && [ "$printed" = 1 ] \
        && ok "both replicas listening, on PostgreSQL, in $(($(date +%s) - t0)) s; the admin credential printed once (by $(pm logs "$A" 2>&1 | grep -c '^admin token' >/dev/null && echo hub-a || echo hub-b))" \
        || bad "admin credential printed $printed times"
else
    for c in "$A" "$B"; do pm logs "$c" 2>&1 | tail -8 | cut -c1-300 | sed "s/^/    $c: /"; done
    bad "replicas did not start"
fi
code=000
for ((i = 0; i < 60; i++)); do   # HAProxy up, and a replica passed its health check
    code="$(curl -s --max-time 5 -o /dev/null -w '%{http_code}' "$TEAM/healthz")"
    [ "$code" = 200 ] || [ "$code" = 503 ] && break
    sleep 0.5
done
if [ "$code" = 200 ] || [ "$code" = 503 ]; then
    up=1
    ok "HAProxy ($H) answers on $TEAM: GET /healthz $code from a replica (503: no runner yet)"
else
    pm logs "$H" 2>&1 | tail -8 | sed 's/^/    haproxy: /'
    bad "HAProxy on $TEAM: GET /healthz gave $code"
fi

# One chat turn through HAProxy's front door; $1 the messages (JSON). Prints the answer's
# content; returns 0 on a completed answer.
turn() {
    local out
    out="$(curl -sS --max-time 60 "$TEAM/v1/chat/completions" -H "Authorization: Bearer $KEY" \
        -H 'Content-Type: application/json' -d "{\"model\":\"sim-model\",\"messages\":$1}")" || return 1
    python3 -c 'import json,sys; d=json.loads(sys.argv[1]); c=d["choices"][0]; print(c["message"]["content"]); sys.exit(0 if c["finish_reason"] == "stop" else 1)' "$out" \
        || { echo "answer: $out"; return 1; }
}
# GET an admin path through HAProxy
admin() { curl -sS --max-time 10 -H "Authorization: Bearer $ADMIN" "$TEAM$1"; }
# The replicas that answered 6 requests through HAProxy (each says which is itself)
answering() {
    for _ in 1 2 3 4 5 6; do
        admin /api/hub/replicas | python3 -c 'import json,sys; print(next(r["id"] for r in json.load(sys.stdin)["replicas"] if r["self"]))' 2>/dev/null
    done | sort | uniq -c | awk '{printf "%s%s x%s", sep, $2, $1; sep=", "}'
}

if [ "$up" = 1 ] && [ -n "$ADMIN" ]; then
t0=$(date +%s%N)
for ((i = 0; i < 20; i++)); do   # until HAProxy's first health checks have passed both
    seen="$(answering)"
    [[ "$seen" == *hub-a* && "$seen" == *hub-b* ]] && break
    sleep 0.5
done
echo "    both replicas answering through HAProxy $((($(date +%s%N) - t0) / 1000000)) ms after the first answer"
[[ "$seen" == *hub-a* && "$seen" == *hub-b* ]] && ok "HAProxy spreads requests over both replicas (GET /api/hub/replicas, who answered: $seen)" \
    || bad "requests through HAProxy reached only: $seen"
# ---------------------------------------------------------------------------------------------
say "3. an API key: hub keys create in a replica's container"
KEY="$(pm exec "$A" alp-gateway hub keys create prove-team 2>"$SCRATCH/keys.err" | tail -1)"
if [[ "$KEY" == *[![:space:]]* ]] && [[ "$KEY" != *" "* ]]; then
    ok "'alp-gateway hub keys create prove-team' in $A (store from team.env's ALP_GATEWAY_HUB_STORE): a key of ${#KEY} characters"
else
    cat "$SCRATCH/keys.err"
    bad "hub keys create: $KEY"
fi

# ---------------------------------------------------------------------------------------------
say "4. a runner registered through HAProxy with an enrollment token, a turn through its front door"
ENROLL="$(pm exec "$A" alp-gateway hub runners enroll --project local/chat --uses 1 2>/dev/null | tail -1)"
[[ "$ENROLL" == alpe_* ]] && ok "'alp-gateway hub runners enroll --project local/chat --uses 1' in $A: an enrollment token" \
    || bad "hub runners enroll: $ENROLL"
pm run -d --name "$P-sim" --network host --no-healthcheck "$IMG" sim --listen "127.0.0.1:$SIM_PORT" --models sim-model >/dev/null
pm run -d --name "$P-runner" --network host --no-healthcheck --stop-timeout 40 \
    -e AGENTICS_SERVER="$TEAM" -e ALP_PROJECT=local/chat -e AGENTICS_USER_TOKEN="$ENROLL" \
    -e CHAT_LLM_BACKEND_URL="http://127.0.0.1:$SIM_PORT/v1" -e ALP_GATEWAY_NAME=team-runner \
    -e ALP_GATEWAY_POLL_INTERVAL=1 -e ALP_GATEWAY_METRICS_LISTEN="127.0.0.1:$METRICS_PORT" "$IMG" run >/dev/null
if wait_log "$P-runner" 90 'health and metrics on'; then
    pm logs "$P-runner" 2>&1 | head -4 | cut -c1-200 | sed 's/^/    runner: /'
    names="$(admin /api/hub/runners | python3 -c 'import json,sys; print(" ".join(sorted(r.get("name","?") + (" (up)" if r.get("up") else "") for r in json.load(sys.stdin)["runners"])))' 2>&1)"
    [[ "$names" == *"team-runner (up)"* ]] && ok "runner registered through HAProxy, on the team: $names" || bad "runner not on the team: $names"
else
    pm logs "$P-runner" 2>&1 | tail -8 | sed 's/^/    runner: /'
    bad "runner did not start"
fi
M1='[{"role":"user","content":"hello from prove-team.sh"}]'
t0=$(date +%s%N)
if out="$(turn "$M1")"; then
    ok "turn 1 through HAProxy's front door in $((($(date +%s%N) - t0) / 1000000)) ms: '$out'"
else
    bad "turn 1 through HAProxy: $out"
fi

# ---------------------------------------------------------------------------------------------
say "5. hub doctor in a replica's container"
doc="$(pm exec "$A" alp-gateway hub doctor 2>&1)"; dcode=$?
echo "$doc" | sed 's/^/    doctor: /'
if [ "$dcode" = 0 ] && echo "$doc" | grep -c 'hub-a' >/dev/null && echo "$doc" | grep -c 'hub-b' >/dev/null; then
    ok "hub doctor exit 0, both replicas shown"
else
    bad "hub doctor exit $dcode"
fi
reps="$(admin /api/hub/replicas)"
echo "$reps" | python3 -c 'import json,sys; [print("    replica %(id)s %(url)s up=%(up)s channels=%(channels)s" % r) for r in json.load(sys.stdin)["replicas"]]' 2>/dev/null

# ---------------------------------------------------------------------------------------------
say "6. the replica holding the runner's channel killed; the next turn through HAProxy"
holder="$(echo "$reps" | python3 -c 'import json,sys; rs=json.load(sys.stdin)["replicas"]; print(max(rs, key=lambda r: r["channels"])["id"] if any(r["channels"] for r in rs) else "hub-a")' 2>/dev/null)"
[ -n "$holder" ] || holder=hub-a
VICTIM="$(cname "$holder")"
SURVIVOR="$A" && [ "$VICTIM" = "$A" ] && SURVIVOR="$B"
echo "    the runner's channel is on $holder: podman kill $VICTIM (SIGKILL)"
redials_before="$(pm logs "$P-runner" 2>&1 | grep -ciE 'redial|reconnect|channel (open|up)')"
ip_before="$(pm inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$VICTIM" 2>/dev/null)"
tk=$(date +%s%N)
pm kill "$VICTIM" >/dev/null
M2="[{\"role\":\"user\",\"content\":\"hello from prove-team.sh\"},{\"role\":\"assistant\",\"content\":$(python3 -c 'import json,sys; print(json.dumps(sys.argv[1]))' "${out:-}")},{\"role\":\"user\",\"content\":\"and after the kill?\"}]"
if out2="$(turn "$M2")"; then
    ok "turn 2, started at once after the kill, served through HAProxy $((($(date +%s%N) - tk) / 1000000)) ms after the kill: '$out2'"
else
    bad "turn 2 after the kill: $out2"
fi
echo "    $VICTIM after podman kill: $(pm inspect -f '{{.State.Status}} exit={{.State.ExitCode}} restarts={{.RestartCount}}' "$VICTIM" 2>&1)"
pm logs "$P-runner" 2>&1 | grep -iE 'redial|reconnect|channel|lost|closed' | tail -4 | cut -c1-200 | sed 's/^/    runner: /'
echo "    runner log lines about its channel: $redials_before before the kill, $(pm logs "$P-runner" 2>&1 | grep -ciE 'redial|reconnect|channel (open|up)') after"
if out3="$(turn '[{"role":"user","content":"a new conversation after the kill"}]')"; then
    ok "turn 3 (a new conversation) served through HAProxy with $holder dead: '$out3'"
else
    bad "turn 3 after the kill: $out3"
fi

seen="$(answering)"
[[ "$seen" != *"$holder"* ]] && ok "HAProxy sends nothing to the dead $holder (who answered: $seen)" || bad "requests reached the dead $holder: $seen"

# ---------------------------------------------------------------------------------------------
say "7. the killed replica back (compose up -d), HAProxy using it again; the other one crashed, back by its restart policy"
t0=$(date +%s) since="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
compose up -d >"$SCRATCH/up2.log" 2>&1 || { tail -5 "$SCRATCH/up2.log"; bad "compose up -d again"; }
VICTIM="$(cname "$holder")"
for ((i = 0; i < 120; i++)); do
    pm logs --since "$since" "$VICTIM" 2>&1 | grep -c 'hub listening on' >/dev/null && break
    sleep 0.5
done
if pm logs --since "$since" "$VICTIM" 2>&1 | grep -c 'hub listening on' >/dev/null; then
    ip_after="$(pm inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$VICTIM" 2>/dev/null)"
    echo "    $VICTIM started again in $(($(date +%s) - t0)) s; its address on the compose network: $ip_before before the kill, $ip_after now"
    back=""
    for ((i = 0; i < 20; i++)); do   # HAProxy's health check (inter 1s, rise 1) takes it back
        seen="$(answering)"
        [[ "$seen" == *"$holder"* ]] && { back=1; break; }
        sleep 0.5
    done
    [ -n "$back" ] && ok "HAProxy sends requests to $holder again (who answered: $seen)" \
        || bad "HAProxy does not use the restarted $holder (who answered: $seen)"
else
    pm logs "$VICTIM" 2>&1 | tail -5 | cut -c1-300 | sed 's/^/    hub: /'
    bad "the killed replica did not start again"
fi

CRASH="$SURVIVOR" && [ "$CRASH" = "$A" ] && crashed=hub-a || crashed=hub-b
pid="$(pm inspect -f '{{.State.Pid}}' "$CRASH" 2>/dev/null)"
echo "    the other replica crashes: kill -9 of its process ($pid) from the host, as the OOM killer would (podman kill counts as stopped by the user)"
since="$(date -u +%Y-%m-%dT%H:%M:%SZ)" t0=$(date +%s%N)
[ -n "$pid" ] && [ "$pid" != 0 ] && kill -9 "$pid"
for ((i = 0; i < 120; i++)); do
    pm logs --since "$since" "$CRASH" 2>&1 | grep -c 'hub listening on' >/dev/null && break
    sleep 0.5
done
restarts="$(pm inspect -f '{{.RestartCount}}' "$CRASH" 2>/dev/null)"
if pm logs --since "$since" "$CRASH" 2>&1 | grep -c 'hub listening on' >/dev/null && [ "${restarts:-0}" -ge 1 ]; then
    ok "restart: unless-stopped brought the crashed $crashed back, listening $((($(date +%s%N) - t0) / 1000000)) ms after the crash (restarts: $restarts)"
    back=""
    for ((i = 0; i < 20; i++)); do
        seen="$(answering)"
        [[ "$seen" == *"$crashed"* ]] && { back=1; break; }
        sleep 0.5
    done
    [ -n "$back" ] && ok "HAProxy sends requests to the restarted $crashed (who answered: $seen)" \
        || bad "HAProxy does not use the restarted $crashed (who answered: $seen)"
else
    echo "    $CRASH: $(pm inspect -f '{{.State.Status}} exit={{.State.ExitCode}} restarts={{.RestartCount}}' "$CRASH" 2>&1)"
    bad "the crashed $crashed was not restarted by its restart policy"
fi
t0=$(date +%s%N)
if out4="$(turn '[{"role":"user","content":"after the crash"}]')"; then
    ok "turn 4 through HAProxy $((($(date +%s%N) - t0) / 1000000)) ms: '$out4'"
else
    bad "turn 4 after the crash: $out4"
fi

# ---------------------------------------------------------------------------------------------
say "8. hub usage in a replica"
usage="$(pm exec "$SURVIVOR" alp-gateway hub usage 2>&1)"; ucode=$?
echo "$usage" | sed 's/^/    usage: /'
turns="$(echo "$usage" | awk '$1 == "prove-team" { s += $3 } END { print s + 0 }')"
if [ "$ucode" = 0 ] && [ "$turns" = 4 ]; then
    ok "hub usage in $SURVIVOR: the key prove-team's 4 turns, each once"
else
    bad "hub usage (exit $ucode): $turns turns for prove-team, 4 expected"
fi
else
    skip "steps 3 to 8: the team did not come up"
fi

# ---------------------------------------------------------------------------------------------
say "9. podman-compose down -v, and what this script started outside compose"
pm stop -t 40 "$P-runner" >/dev/null 2>&1
echo "    runner stopped: exit $(pm inspect -f '{{.State.ExitCode}}' "$P-runner" 2>&1)"
t0=$(date +%s)
compose down -v >"$SCRATCH/down.log" 2>&1
for c in "$P-runner" "$P-sim"; do pm rm -f -v -t 0 "$c" >/dev/null 2>&1; done
left="$(pm ps -aq --filter "label=io.podman.compose.project=$PROJ" | wc -l) containers, $(pm volume ls -q --filter "label=io.podman.compose.project=$PROJ" | wc -l) volumes, network $(pm network exists "${PROJ}_default" && echo left || echo gone), pod $(pm pod exists "pod_$PROJ" && echo left || echo gone)"
[ "$left" = "0 containers, 0 volumes, network gone, pod gone" ] && ok "down -v in $(($(date +%s) - t0)) s: $left" || { tail -5 "$SCRATCH/down.log"; bad "left after down -v: $left"; }

echo "    left on purpose, for the next run: the images; untagged ones on this machine now: $(pm images -q --filter dangling=true | wc -l) (podman image prune removes them: a build whose files changed leaves its build stage's, about 700 MB on vfs)"

printf '\n=== summary (%s, %d s)\n' "$(date +%T)" "$(($(date +%s) - T_START))"
printf '%s\n' "${RESULTS[@]}"
exit "$failed"
