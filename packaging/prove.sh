#!/usr/bin/env bash
# Prove the deployment recipes where they run, end to end, on one Debian 12 machine with podman
# (no Docker, no container registry needed). Prints each step's result and a summary; exit 0 when
# every step passed. Rerunnable: images and the base root are reused, containers and volumes of
# an earlier run are removed first.
#
#   sudo packaging/prove.sh            # from the repository root or anywhere
#
# What it proves (packaging/DEPLOY.md, "Proven"):
#   1. the image from packaging/Dockerfile builds, on stand-in bases made here (no registry needed):
#      a Debian 12 root from debootstrap, with Python 3.11 for the build stage, and a
#      distroless-like runtime base
#   2. the hub recipe: the image running `alp-gateway hub` (named volume for its data), API keys
#      made with `hub keys create` in the running container and with POST /api/hub/keys
#   3. the Kubernetes emptyDir case: the runner as uid 65532 on a bind-mounted, root-owned 0777
#      state directory, read-only root, /tmp a tmpfs with exec: registers, serves a turn through
#      the hub's front door, `status` healthy, SIGTERM drains and exits 0, a second container on
#      the same directory reuses the registration
#   4. compose.yaml's gateway service translated to `podman run` flags (env_file, environment with
#      its ${VAR:-default}s, the named volume `state`, read_only, tmpfs, cap_drop, security_opt,
#      stop_grace_period), the backend reached as http://ollama:11434/v1 as in the file
#   5. systemd-analyze verify (and security --offline) on packaging/systemd/*.service
#   6. the hub container stopped (exit 0) and started again: its keys kept on the named volume
#
# Needs root, podman, runc, debootstrap, systemd (systemd-analyze), curl; python3 for JSON.
# The Debian root comes from this machine's own apt source (packaging/debian-mirror.sh);
# DEBIAN_MIRROR=URL names another mirror.
# Networking: --network host, everything on 127.0.0.1 (loopback only). Ports: PROVE_HUB_PORT
# (default 18787) for the hub; the compose run's backend must answer at ollama:11434, so port
# 11434 on 127.0.0.1 must be free (the step is skipped, saying so, if it is not).
set -uo pipefail
ROOT_DIR="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT_DIR" || exit 2
PM=(podman --storage-driver vfs --runtime runc --cgroup-manager cgroupfs)
IMG=localhost/alp-gateway:prove
HUB_PORT="${PROVE_HUB_PORT:-18787}"
SIM_PORT="${PROVE_SIM_PORT:-18800}"
NICE=(nice -n 19 ionice -c3)
P=alp-prove   # prefix of every container and volume made here
SCRATCH="$(mktemp -d)"
declare -a RESULTS=()
ADMIN="" KEY="" hub_up=0
failed=0

# shellcheck source=packaging/prove-lib.sh
. "$ROOT_DIR/packaging/prove-lib.sh"
cleanup() {
    for c in "$P-gw" "$P-gw2" "$P-compose" "$P-hub" "$P-sim" "$P-ollama"; do
        pm rm -f -v -t 0 "$c" >/dev/null 2>&1
    done
    rm -rf "$SCRATCH"
}
trap cleanup EXIT

[ "$(id -u)" = 0 ] || { echo "prove.sh: run as root" >&2; exit 2; }
for tool in podman runc debootstrap systemd-analyze curl python3; do
    command -v "$tool" >/dev/null || { echo "prove.sh: $tool missing (apt-get install -y podman runc debootstrap systemd curl)" >&2; exit 2; }
done
# podman's default ulimits cannot be set in some sandboxes (a container without CAP_SYS_RESOURCE)
if [ ! -e /etc/containers/containers.conf ]; then
    mkdir -p /etc/containers && printf '[containers]\ndefault_ulimits = []\n' >/etc/containers/containers.conf
fi
echo "prove.sh: (lines from podman saying \"unable to get systemd connection ... healthchecks\" are harmless: no systemd runs here to time health checks)"
echo "prove.sh: $(date -u '+%F %T UTC'), $(uname -m), $(nproc) cores, $(. /etc/os-release; echo "$PRETTY_NAME"), $(podman --version), commit $(git -C "$ROOT_DIR" rev-parse --short HEAD 2>/dev/null)"
for c in "$P-gw" "$P-gw2" "$P-compose" "$P-hub" "$P-sim" "$P-ollama"; do pm rm -f -v -t 0 "$c" >/dev/null 2>&1; done
for v in "$P-hub-data" "$P-state"; do pm volume rm -f "$v" >/dev/null 2>&1; done

# ---------------------------------------------------------------------------------------------
say "1. stand-in base images (debootstrap) and the project's image"
make_bases || exit 1
echo "    runtime stand-in $RT: $(pm image inspect -f '{{.Size}}' "$RT" | awk '{printf "%.1f MB", $1/1e6}'), a shell in it: $(pm run --rm --entrypoint /bin/sh "$RT" -c true >/dev/null 2>&1 && echo yes || echo no)"
quiet_wait
t0=$(date +%s)
# --format docker keeps the Dockerfile's HEALTHCHECK (podman's default OCI format drops it)
if "${NICE[@]}" "${PM[@]}" build --format docker --network host -f packaging/Dockerfile \
    --build-arg PYTHON_IMAGE="$PY" \
    --build-arg RUNTIME_IMAGE="$RT" -t "$IMG" . >"$SCRATCH/build.log" 2>&1; then
    ok "image $IMG built in $(($(date +%s) - t0)) s: $(pm run --rm "$IMG" --version), runs as user $(pm image inspect -f '{{.Config.User}}' "$IMG")"
else
    tail -20 "$SCRATCH/build.log"
    bad "image build"
    exit 1
fi

# ---------------------------------------------------------------------------------------------
say "2. the hub in the container (alp-gateway hub, data on a named volume) and a backend"
pm volume create "$P-hub-data" >/dev/null
# --no-healthcheck: the image's health check reads the runner's metrics port, which a hub lacks
pm run -d --name "$P-hub" --network host --stop-timeout 40 --no-healthcheck -v "$P-hub-data:/var/lib/alp-gateway" \
    --read-only --tmpfs /tmp:exec,mode=1777,size=160m --cap-drop ALL --security-opt no-new-privileges \
    "$IMG" hub --listen "127.0.0.1:$HUB_PORT" >/dev/null
# the simulator stands in for Ollama (`alp-gateway sim`, from the same image)
pm run -d --name "$P-sim" --network host --no-healthcheck --read-only --tmpfs /tmp:exec,mode=1777,size=160m \
    "$IMG" sim --listen "127.0.0.1:$SIM_PORT" --models sim-model >/dev/null
if wait_log "$P-hub" 60 'hub listening on'; then
    ADMIN="$(pm logs "$P-hub" 2>&1 | grep -A1 '^admin token' | tail -1 | tr -d ' \r')"
    pm logs "$P-hub" 2>&1 | grep -v "$ADMIN" | sed 's/^/    hub: /'
    KEY="$(pm exec "$P-hub" alp-gateway hub keys create prove 2>/dev/null | tail -1)"
    # the runners register with an enrollment token of their project, never the admin credential
    ENROLL="$(pm exec "$P-hub" alp-gateway hub runners enroll --project local/chat 2>/dev/null | tail -1)"
    if [ -n "$ADMIN" ] && [[ "$KEY" != *error* ]] && [ -n "$KEY" ] && [[ "$ENROLL" == alpe_* ]]; then
        hub_up=1
        ok "hub container up on 127.0.0.1:$HUB_PORT as user $(pm top "$P-hub" user 2>/dev/null | tail -1), admin credential printed once, API key and enrollment token made with 'hub keys create' and 'hub runners enroll' in the running container"
    else
        bad "hub admin credential or key: admin=${ADMIN:+set} key=$KEY"
    fi
else
    pm logs "$P-hub" 2>&1 | tail -10
    bad "hub container did not start"
fi
# an API key the other way, as packaging/systemd/alp-gateway-hub.service suggests: the admin API
KEY2="$(curl -sS --max-time 10 -H "Authorization: Bearer $ADMIN" -d '{"name":"prove-api"}' \
    "http://127.0.0.1:$HUB_PORT/api/hub/keys" | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])' 2>/dev/null)"
[ -n "$KEY2" ] && ok "API key made with POST /api/hub/keys (admin credential)" || bad "POST /api/hub/keys"
echo "    'alp-gateway status' in the hub container exits $(pm exec "$P-hub" alp-gateway status >/dev/null 2>&1; echo $?) (2: nothing on the runner's 127.0.0.1:9464), which is why the hub runs with --no-healthcheck"
curl -s --max-time 5 "http://127.0.0.1:$SIM_PORT/v1/models" >/dev/null \
    && ok "simulator container answers on 127.0.0.1:$SIM_PORT" || bad "simulator container"
HUB="http://127.0.0.1:$HUB_PORT"

# One chat turn through the hub's front door; prints the content, returns 0 on a completed answer.
turn() {
    local out
    out="$(curl -sS --max-time 60 "$HUB/v1/chat/completions" -H "Authorization: Bearer $KEY" \
        -H 'Content-Type: application/json' \
        -d '{"model":"sim-model","messages":[{"role":"user","content":"hello from prove.sh"}]}')" || return 1
    python3 -c 'import json,sys; d=json.loads(sys.argv[1]); c=d["choices"][0]; print(repr(c["message"]["content"]), "finish_reason=" + str(c["finish_reason"])); sys.exit(0 if c["finish_reason"] == "stop" else 1)' "$out" \
        || { echo "    answer: $out"; return 1; }
}
# Runner flags shared by the emptyDir and compose runs: the hardening of compose.yaml / k8s.
# shellcheck disable=SC2054  # the commas are the tmpfs mount's options, one argument
HARDEN=(--read-only --tmpfs /tmp:exec,mode=1777,size=160m --cap-drop ALL --security-opt no-new-privileges)
# The image's health check stays defined (podman healthcheck run uses it) but gets no timer:
# podman schedules those with systemd, which does not run here.
HARDEN+=(--health-interval disable)

# ---------------------------------------------------------------------------------------------
if [ "$hub_up" = 1 ]; then  # steps 3 and 4 need the hub
say "3. Kubernetes emptyDir case: uid 65532, state dir a root-owned 0777 bind mount"
EMPTYDIR="$SCRATCH/emptydir" && mkdir -p "$EMPTYDIR" && chown 0:0 "$EMPTYDIR" && chmod 0777 "$EMPTYDIR"
echo "    host dir: $(stat -c '%A %U:%G' "$EMPTYDIR")"
run_gw() {
    pm run -d --name "$1" --network host --user 65532:65532 --stop-timeout 40 "${HARDEN[@]}" \
        -v "$EMPTYDIR:/var/lib/alp-gateway" \
        -e AGENTICS_SERVER="$HUB" -e ALP_PROJECT=local/chat -e AGENTICS_USER_TOKEN="$ENROLL" \
        -e CHAT_LLM_BACKEND_URL="http://127.0.0.1:$SIM_PORT/v1" -e ALP_GATEWAY_NAME="$1" \
        -e ALP_GATEWAY_POLL_INTERVAL=1 "$IMG" run >/dev/null
}
run_gw "$P-gw"
if wait_log "$P-gw" 60 'health and metrics on' && sleep 2 \
    && [ "$(pm inspect -f '{{.State.Running}}' "$P-gw")" = true ]; then
    pm logs "$P-gw" 2>&1 | head -8 | sed 's/^/    gw: /'
    echo "    state: $(cd "$EMPTYDIR" && find . -printf '%M %u:%g %p\n' | sed 's/^/ /' | tr '\n' ';')"
    ok "runner up as uid 65532 on the root-owned 0777 directory (registration in its uid-65532 subdirectory)"
    if out=$(turn); then ok "a turn through the hub's front door served by the emptyDir runner: $out"; else bad "turn via the emptyDir runner: $out"; fi
    st="$(pm exec "$P-gw" alp-gateway status 2>&1)"
    echo "$st" | head -6 | sed 's/^/    status: /'
    echo "$st" | grep -c 'healthy: ok' >/dev/null && ok "'alp-gateway status' in the container: healthy" || bad "status not healthy"
    hc="$(pm healthcheck run "$P-gw" 2>&1)"; hcode=$?
    [ "$hcode" = 0 ] && ok "the image's HEALTHCHECK (podman healthcheck run): ${hc:-healthy}" || bad "HEALTHCHECK: $hc (exit $hcode)"
    t0=$(date +%s%N)
    pm stop -t 40 "$P-gw" >/dev/null
    code="$(pm inspect -f '{{.State.ExitCode}}' "$P-gw")"
    pm logs "$P-gw" 2>&1 | tail -2 | sed 's/^/    gw: /'
    [ "$code" = 0 ] && ok "podman stop: drained and exited 0 in $((($(date +%s%N) - t0) / 1000000)) ms" || bad "podman stop: exit code $code"
    run_gw "$P-gw2"
    if wait_log "$P-gw2" 60 'health and metrics on' && out=$(turn); then
        if pm logs "$P-gw2" 2>&1 | grep -Eci 'registered (as )?runner' >/dev/null; then
            bad "second container registered again instead of reusing the saved registration"
        else
            ok "a new container on the same directory reused the registration and served a turn: $out"
        fi
    else
        pm logs "$P-gw2" 2>&1 | tail -5
        bad "second container on the same directory"
    fi
    pm stop -t 40 "$P-gw2" >/dev/null
else
    echo "    runner output:"
    pm logs "$P-gw" 2>&1 | tail -8 | sed 's/^/    gw: /'
    echo "    restarts would loop: state $(pm inspect -f '{{.State.Status}} exit={{.State.ExitCode}}' "$P-gw")"
    bad "runner as uid 65532 on a root-owned 0777 state directory"
fi

# ---------------------------------------------------------------------------------------------
say "4. compose.yaml's gateway service by hand (podman run), with its named volume"
# Each compose line translated below must still be in the file, or the translation is stale.
missing=0
for line in 'env_file:' '- gateway.env' 'ALP_PROJECT: ${ALP_PROJECT:?' 'AGENTICS_SERVER: ${AGENTICS_SERVER:-agentics.dk}' \
    'CHAT_LLM_BACKEND_URL: http://ollama:11434/v1' 'CHAT_LLM_MODEL: ${CHAT_LLM_MODEL:-qwen2.5:7b}' \
    'ALP_GATEWAY_NAME: ${ALP_GATEWAY_NAME:-compose-gateway}' 'ALP_GATEWAY_LOG_FORMAT: json' \
    '- state:/var/lib/alp-gateway' 'read_only: true' '- /tmp:exec,mode=1777,size=160m' 'cap_drop: [ALL]' \
    '- no-new-privileges:true' 'stop_grace_period: 40s' 'restart: unless-stopped'; do
    grep -qF -- "$line" packaging/compose.yaml || { echo "    compose.yaml no longer has: $line"; missing=1; }
done
[ "$missing" = 0 ] && ok "compose.yaml still has every line translated here" || bad "compose.yaml changed: update prove.sh's translation"
if (exec 3<>/dev/tcp/127.0.0.1/11434) 2>/dev/null; then
    skip "compose run: something already listens on 127.0.0.1:11434 (the 'ollama' stand-in needs it)"
else
    # the ollama service: the simulator under the name ollama, on Ollama's port, serving the
    # model compose.yaml defaults to
    pm run -d --name "$P-ollama" --network host --no-healthcheck --read-only --tmpfs /tmp:exec,mode=1777,size=160m \
        "$IMG" sim --listen 127.0.0.1:11434 --models qwen2.5:7b >/dev/null
    # env_file: gateway.env from gateway.env.example, filled in, mode 600
    envf="$SCRATCH/gateway.env"
    sed "s|^AGENTICS_USER_TOKEN=.*|AGENTICS_USER_TOKEN=$ENROLL|" packaging/gateway.env.example >"$envf"
    chmod 600 "$envf"
    # the variables compose interpolates: ALP_PROJECT (required), AGENTICS_SERVER set; the rest
    # keep the file's defaults
    ALP_PROJECT=local/chat AGENTICS_SERVER="$HUB"
    pm volume create "$P-state" >/dev/null   # volumes: state: (a named volume)
    pm run -d --name "$P-compose" --network host --add-host ollama:127.0.0.1 \
        --restart unless-stopped --stop-timeout 40 \
        --env-file "$envf" \
        -e ALP_PROJECT="${ALP_PROJECT:?}" -e AGENTICS_SERVER="${AGENTICS_SERVER:-agentics.dk}" \
        -e CHAT_LLM_BACKEND_URL=http://ollama:11434/v1 -e CHAT_LLM_MODEL="${CHAT_LLM_MODEL:-qwen2.5:7b}" \
        -e ALP_GATEWAY_NAME="${ALP_GATEWAY_NAME:-compose-gateway}" -e ALP_GATEWAY_LOG_FORMAT=json \
        -v "$P-state:/var/lib/alp-gateway" "${HARDEN[@]}" \
        "$IMG" >/dev/null
    if wait_log "$P-compose" 60 'health and metrics on'; then
        pm logs "$P-compose" 2>&1 | head -4 | cut -c1-200 | sed 's/^/    gw: /'
        pm logs "$P-compose" 2>&1 | head -3 | python3 -c 'import json,sys; [json.loads(l) for l in sys.stdin if l.strip()]' \
            && ok "ALP_GATEWAY_LOG_FORMAT=json: the log lines are JSON objects" || bad "log lines are not JSON"
        vol="$(pm volume inspect -f '{{.Mountpoint}}' "$P-state")"
        echo "    named volume: $(stat -c '%A %u:%g' "$vol") $(ls -ln "$vol" | tail -n +2 | awk '{print $1, $3":"$4, $9}' | tr '\n' ' ')"
        [ "$(stat -c %u "$vol")" = 65532 ] && [ -f "$vol/registration.json" ] \
            && ok "named volume 'state' took the image's 65532-owned /var/lib/alp-gateway; registration.json directly in it" \
            || bad "named volume ownership or registration file"
        if out=$(curl -sS --max-time 60 "$HUB/v1/chat/completions" -H "Authorization: Bearer ${KEY2:-$KEY}" \
            -H 'Content-Type: application/json' \
            -d '{"model":"qwen2.5:7b","messages":[{"role":"user","content":"hi"}]}' \
            | python3 -c 'import json,sys; c=json.load(sys.stdin)["choices"][0]; print(repr(c["message"]["content"]), c["finish_reason"]); sys.exit(c["finish_reason"] != "stop")'); then
            ok "a turn for qwen2.5:7b (CHAT_LLM_MODEL's default) reached the backend at http://ollama:11434/v1: $out"
        else
            bad "turn through the compose-style runner: $out"
        fi
        names="$(curl -sS -H "Authorization: Bearer $ADMIN" "$HUB/api/hub/runners" 2>/dev/null | python3 -c 'import json,sys; d=json.load(sys.stdin); rs=d.get("runners", d) if isinstance(d, dict) else d; print(" ".join(sorted({r.get("name","?") for r in rs})))' 2>/dev/null)"
        [[ " $names " == *" compose-gateway "* ]] && ok "runner named by ALP_GATEWAY_NAME's default on the hub (runners: $names)" \
            || bad "runner name compose-gateway not on the hub (runners: $names)"
        pm stop -t 40 "$P-compose" >/dev/null
        code="$(pm inspect -f '{{.State.ExitCode}}' "$P-compose")"
        [ "$code" = 0 ] && ok "stop: exit 0" || bad "stop: exit $code"
        pm rm -f -v "$P-compose" >/dev/null
        pm run -d --name "$P-compose" --network host --add-host ollama:127.0.0.1 --env-file "$envf" \
            -e ALP_PROJECT=local/chat -e AGENTICS_SERVER="$HUB" -e CHAT_LLM_BACKEND_URL=http://ollama:11434/v1 \
            -e CHAT_LLM_MODEL=qwen2.5:7b -e ALP_GATEWAY_NAME=compose-gateway -e ALP_GATEWAY_LOG_FORMAT=json \
            -v "$P-state:/var/lib/alp-gateway" "${HARDEN[@]}" "$IMG" >/dev/null
        if wait_log "$P-compose" 60 'health and metrics on' && ! pm logs "$P-compose" 2>&1 | grep -Eci 'registered (as )?runner' >/dev/null; then
            ok "a re-created container on the named volume reused the registration"
        else
            bad "re-created container registered again (or did not start)"
        fi
        pm stop -t 40 "$P-compose" >/dev/null
    else
        pm logs "$P-compose" 2>&1 | tail -8 | sed 's/^/    gw: /'
        bad "compose-style runner did not start"
    fi
fi

else
    skip "steps 3 and 4: the hub did not come up"
fi

# ---------------------------------------------------------------------------------------------
say "5. systemd units: systemd-analyze verify and security --offline"
sysroot="$SCRATCH/sysroot"
bin="$SCRATCH/alp-gateway"
cid="$(pm create "$IMG")" && pm cp "$cid:/usr/local/bin/alp-gateway" "$bin" && pm rm -v "$cid" >/dev/null
for unit in packaging/systemd/*.service; do
    name="$(basename "$unit")"
    # verify checks that ExecStart's program exists: point it at the binary from the image
    mkdir -p "$sysroot"
    sed "s|/usr/local/bin/alp-gateway|$bin|" "$unit" >"$sysroot/$name"
    if out="$(systemd-analyze verify "$sysroot/$name" 2>&1)" && [ -z "$out" ]; then
        ok "systemd-analyze verify $name: no findings"
    else
        echo "$out" | sed 's/^/    /'
        bad "systemd-analyze verify $name"
    fi
    sec="$(systemd-analyze security --offline=true "$sysroot/$name" 2>&1 | tail -1)"
    echo "    $name: $sec"
done
# the hub's TLS drop-in as packaging/DEPLOY.md section 5 gives it (LoadCredential=, %d)
mkdir -p "$sysroot/alp-gateway-hub.service.d"
cat >"$sysroot/alp-gateway-hub.service.d/tls.conf" <<'EOF'
[Service]
LoadCredential=hub.crt:/etc/alp-gateway/hub.crt
LoadCredential=hub.key:/etc/alp-gateway/hub.key
Environment="HUB_LISTEN=0.0.0.0:8787" "HUB_ARGS=--tls-cert %d/hub.crt --tls-key %d/hub.key"
EOF
if out="$(SYSTEMD_UNIT_PATH="$sysroot:" systemd-analyze verify alp-gateway-hub.service 2>&1)" && [ -z "$out" ]; then
    ok "systemd-analyze verify alp-gateway-hub.service with the TLS drop-in: no findings"
else
    echo "$out" | sed 's/^/    /'
    bad "systemd-analyze verify with the TLS drop-in"
fi

# ---------------------------------------------------------------------------------------------
say "6. the hub stopped, then started again on its volume"
pm stop -t 40 "$P-hub" >/dev/null
code="$(pm inspect -f '{{.State.ExitCode}}' "$P-hub")"
pm logs "$P-hub" 2>&1 | tail -1 | sed 's/^/    hub: /'
[ "$code" = 0 ] && ok "hub container: podman stop, exit 0" || bad "hub container stop: exit $code"
pm start "$P-hub" >/dev/null
for ((i = 0; i < 120; i++)); do
    [ "$(pm logs "$P-hub" 2>&1 | grep -c 'hub listening on')" -ge 2 ] && break
    sleep 0.5
done
if [ "$(pm inspect -f '{{.State.Running}}' "$P-hub")" = true ]; then
    # no runner is up now, so /v1/models answers 503 to a good key; an unknown key gets 401
    models="$(curl -s --max-time 10 -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $KEY" "$HUB/v1/models")"
    wrong="$(curl -s --max-time 10 -o /dev/null -w '%{http_code}' -H "Authorization: Bearer not-$KEY" "$HUB/v1/models")"
    admins="$(pm logs "$P-hub" 2>&1 | grep -c '^admin token')"
    [ "$wrong" = 401 ] && [ "$models" != 401 ] && [ "$models" != 000 ] && [ "$admins" = 1 ] \
        && ok "hub restarted on its volume: the API key still accepted (GET /v1/models: $models; an unknown key: $wrong), no new admin credential" \
        || bad "hub restart: GET /v1/models $models (unknown key $wrong), admin credential printed $admins times"
    pm stop -t 40 "$P-hub" >/dev/null
fi

printf '\n=== summary (%s)\n' "$(date +%T)"
printf '%s\n' "${RESULTS[@]}"
exit "$failed"
