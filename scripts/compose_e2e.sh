#!/usr/bin/env bash
# End to end through containers: build the CPU image, `compose up` Redis, the scheduler,
# 2 prefill and 2 decode replicas and the frontend, run a real workload through the
# frontend's port (tests/deploy/compose_e2e_workload.py), `compose down`, leave nothing.
#
#   bash scripts/compose_e2e.sh            (make test runs it after the unit tests)
#
# Works where registries are reachable and where none is:
# - engine: Docker when its daemon answers and `docker compose` exists; else podman, installed
#   from apt when missing, with podman-compose 1.6 from PyPI in a cached venv. Where no
#   engine can be had, prints "compose_e2e: skipped: <why>" and exits 0.
# - base image: debian:bookworm-slim pulled, else `debootstrap --variant=minbase bookworm`
#   from the mirror apt uses, imported. Redis: redis:7.4-alpine pulled, else Debian's
#   redis-server installed on that base (scripts/redis.Dockerfile).
# - the host's pip configuration (find-links, local indexes, constraints) and CA bundle are
#   read at run time (scripts/container_build_env.py) and mounted into the build.
# Cached on purpose between runs: the base, Redis and tandem images and the build's layers
# (a warm run rebuilds only what changed; the image a rebuild replaces is removed with its
# own layers), podman-compose's venv. The image carries the default model converted, so a
# fresh model-cache volume starts with it. Everything else the run
# creates (containers, pod, network, volumes, temp files) is removed on every exit path.
#
# Environment: TANDEM_E2E_CACHE (default ~/.cache/tandem/compose-e2e), TANDEM_E2E_PYTHON (the
# project's interpreter, default .venv/bin/python), TANDEM_E2E_READY_TIMEOUT_S (900).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${TANDEM_E2E_PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
CACHE=${TANDEM_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem/compose-e2e}
PROJECT=tandem-e2e
BASE_TAG=localhost/tandem-base:bookworm
REDIS_TAG=localhost/tandem-redis:bookworm
IMAGE_TAG=localhost/tandem:cpu
READY_TIMEOUT_S=${TANDEM_E2E_READY_TIMEOUT_S:-900}
PODMAN_COMPOSE_VERSION=1.6.0
T0=$(date +%s)
WORK=$(mktemp -d -t tandem-compose-e2e.XXXXXX)
ENGINE=""
COMPOSE=()
UP=0

log() { printf '[compose_e2e %4ss] %s\n' "$(($(date +%s) - T0))" "$*" >&2; }
skip() {
    echo "compose_e2e: skipped: $*"
    exit 0
}
die() {
    echo "compose_e2e: FAILED: $*" >&2
    exit 1
}

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo -n "$@"
    else
        return 1
    fi
}

apt_install() {
    command -v apt-get >/dev/null 2>&1 || return 1
    export DEBIAN_FRONTEND=noninteractive
    as_root timeout 600 apt-get install -y -qq --no-install-recommends "$@" >"$WORK/apt.log" 2>&1 \
        || {
            as_root timeout 300 apt-get update -qq >>"$WORK/apt.log" 2>&1 \
                && as_root timeout 600 apt-get install -y -qq --no-install-recommends "$@" \
                    >>"$WORK/apt.log" 2>&1
        }
}

# ------------------------------------------------------------------------------- cleanup
compose() { timeout "${COMPOSE_TIMEOUT_S:-300}" "${COMPOSE[@]}" "$@"; }

# Volumes the project's containers mount, named and anonymous (an image's VOLUME where
# compose mounts nothing): `down -v` removes only the named ones under podman-compose.
VOLUMES_FILE="$WORK/volumes"
record_volumes() {
    local ids
    ids=$(timeout 60 "$ENGINE" ps -aq --filter "label=com.docker.compose.project=$PROJECT" 2>/dev/null || true)
    [ -n "$ids" ] || return 0
    # shellcheck disable=SC2086
    timeout 60 "$ENGINE" inspect --format \
        '{{range .Mounts}}{{if eq .Type "volume"}}{{.Name}}{{"\n"}}{{end}}{{end}}' $ids \
        2>/dev/null | grep -v '^$' >>"$VOLUMES_FILE" || true
}

leftovers() {
    # What a compose project leaves when `down` misses something (labels both tools set).
    local label="label=com.docker.compose.project=$PROJECT" v
    timeout 60 "$ENGINE" ps -aq --filter "$label"
    timeout 60 "$ENGINE" volume ls -q --filter "$label"
    if [ -s "$VOLUMES_FILE" ]; then
        sort -u "$VOLUMES_FILE" | while read -r v; do
            timeout 60 "$ENGINE" volume inspect "$v" >/dev/null 2>&1 && echo "$v"
        done
    fi
    timeout 60 "$ENGINE" network ls -q --filter "$label"
    if [ "$ENGINE" = podman ]; then
        timeout 60 podman pod ls -q --filter "name=^pod_${PROJECT}\$"
    fi
}

teardown() {
    [ -n "$ENGINE" ] || return 0
    record_volumes
    if [ "$UP" -eq 1 ] || [ -n "$(leftovers 2>/dev/null)" ]; then
        log "compose down"
        COMPOSE_TIMEOUT_S=180 compose down -v -t 10 >"$WORK/down.log" 2>&1 || true
    fi
    # Anything `down` missed (a run killed mid-way, a replica it did not know of).
    local label="label=com.docker.compose.project=$PROJECT" ids
    ids=$(timeout 60 "$ENGINE" ps -aq --filter "$label" 2>/dev/null || true)
    [ -z "$ids" ] || timeout 120 "$ENGINE" rm -f -v -t 5 $ids >/dev/null 2>&1 || true
    if [ "$ENGINE" = podman ]; then
        timeout 60 podman pod rm -f "pod_$PROJECT" >/dev/null 2>&1 || true
    fi
    ids=$(timeout 60 "$ENGINE" volume ls -q --filter "$label" 2>/dev/null || true)
    [ -s "$VOLUMES_FILE" ] && ids="$ids $(sort -u "$VOLUMES_FILE" | tr '\n' ' ')"
    for v in $ids; do
        timeout 60 "$ENGINE" volume rm -f "$v" >/dev/null 2>&1 || true
    done
    ids=$(timeout 60 "$ENGINE" network ls -q --filter "$label" 2>/dev/null || true)
    [ -z "$ids" ] || timeout 60 "$ENGINE" network rm $ids >/dev/null 2>&1 || true
}

on_exit() {
    local rc=$?
    set +e
    if [ "$rc" -ne 0 ] && [ "$UP" -eq 1 ]; then
        echo "---- container logs (last 40 lines each) ----" >&2
        for c in $(timeout 60 "$ENGINE" ps -a --format '{{.Names}}' \
            --filter "label=com.docker.compose.project=$PROJECT" 2>/dev/null); do
            echo "---- $c" >&2
            timeout 30 "$ENGINE" logs --tail 40 "$c" 2>&1 | sed 's/^/    /' >&2
        done
    fi
    teardown
    rm -rf "$WORK"
    exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

# ------------------------------------------------------------------------------- engine
use_docker() {
    command -v docker >/dev/null 2>&1 || return 1
    timeout 20 docker info >/dev/null 2>&1 || return 1
    timeout 20 docker compose version >/dev/null 2>&1 || return 1
    ENGINE=docker
    COMPOSE=(docker compose -p "$PROJECT" -f compose.yaml -f compose.cpu.yaml)
}

# podman 4.3 on hosts without systemd and with hybrid cgroups: runc (crun refuses them),
# cgroupfs, file events, ulimits within the host's hard limits. Written only where the
# host has no containers.conf of its own.
configure_podman() {
    local conf=/etc/containers/containers.conf
    [ -e "$conf" ] && return 0
    local nofile nproc
    nofile=$(ulimit -Hn)
    nproc=$(ulimit -Hu)
    [ "$nofile" = unlimited ] && nofile=1048576
    [ "$nproc" = unlimited ] && nproc=1048576
    [ "$nofile" -gt 20000 ] && nofile=20000
    [ "$nproc" -gt 32768 ] && nproc=32768
    log "writing $conf (runc, cgroupfs, file events, nofile=$nofile nproc=$nproc)"
    as_root mkdir -p /etc/containers
    as_root tee "$conf" >/dev/null <<EOF
# Written by tandem's scripts/compose_e2e.sh: podman without systemd on hybrid cgroups.
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
}

use_podman() {
    if ! command -v podman >/dev/null 2>&1 || ! command -v runc >/dev/null 2>&1 \
        || ! command -v catatonit >/dev/null 2>&1; then
        log "installing podman from apt"
        apt_install podman runc catatonit netavark aardvark-dns slirp4netns uidmap iptables \
            || skip "no container engine: docker has no daemon here and podman cannot be installed ($(tail -1 "$WORK/apt.log" 2>/dev/null || echo 'no apt-get'))"
    fi
    configure_podman
    timeout 60 podman info >/dev/null 2>&1 || skip "podman is installed but does not run here ($(timeout 60 podman info 2>&1 | tail -1))"
    local venv="$CACHE/podman-compose-venv"
    if ! "$venv/bin/podman-compose" version 2>/dev/null | grep -q "$PODMAN_COMPOSE_VERSION"; then
        log "installing podman-compose $PODMAN_COMPOSE_VERSION into $venv"
        rm -rf "$venv"
        python3 -m venv "$venv" \
            && timeout 300 "$venv/bin/pip" install -q "podman-compose==$PODMAN_COMPOSE_VERSION" \
            || skip "podman-compose $PODMAN_COMPOSE_VERSION cannot be installed from PyPI"
    fi
    ENGINE=podman
    COMPOSE=("$venv/bin/podman-compose" -p "$PROJECT" -f compose.yaml -f compose.cpu.yaml)
}

mkdir -p "$CACHE"
use_docker || use_podman
log "engine: $ENGINE ($("$ENGINE" --version 2>/dev/null))"
# One run at a time on a machine: the project name and the image tags are shared.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$CACHE/lock"
    flock -w 1800 9 || die "another compose_e2e run held $CACHE/lock for 30 minutes"
fi
# A run killed earlier may have left its project behind.
teardown

# ------------------------------------------------------------------------------- images
image_exists() { timeout 60 "$ENGINE" image inspect "$1" >/dev/null 2>&1; }

debian_mirror() {
    # The mirror apt uses (deb822 sources or sources.list), default deb.debian.org.
    local uri
    uri=$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list \
        | grep -m1 -E 'debian/?$|debian[[:space:]]' \
        | sed -E 's/^URIs:[[:space:]]*//; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//' \
        | awk '{print $1}' || true)
    echo "${uri:-http://deb.debian.org/debian}"
}

make_base() {
    image_exists "$BASE_TAG" && return 0
    log "base image: pulling debian:bookworm-slim"
    if timeout 180 "$ENGINE" pull docker.io/library/debian:bookworm-slim >"$WORK/pull.log" 2>&1; then
        "$ENGINE" tag docker.io/library/debian:bookworm-slim "$BASE_TAG"
        return 0
    fi
    log "no registry ($(tail -1 "$WORK/pull.log")); debootstrapping Debian 12"
    command -v debootstrap >/dev/null 2>&1 || apt_install debootstrap \
        || die "debootstrap is missing and cannot be installed"
    local mirror root="$WORK/rootfs"
    mirror=$(debian_mirror)
    as_root timeout 900 debootstrap --variant=minbase bookworm "$root" "$mirror" \
        >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log" >&2; die "debootstrap failed"; }
    as_root rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    as_root tar -C "$root" -c . | timeout 600 "$ENGINE" import \
        --change 'CMD ["/bin/bash"]' - "$BASE_TAG" >"$WORK/import.log" 2>&1 \
        || { tail -5 "$WORK/import.log" >&2; die "importing the base image failed"; }
    as_root rm -rf "$root"
}

make_redis() {
    image_exists "$REDIS_TAG" && return 0
    log "redis image: pulling redis:7.4-alpine"
    if timeout 180 "$ENGINE" pull docker.io/library/redis:7.4-alpine >"$WORK/pull.log" 2>&1; then
        "$ENGINE" tag docker.io/library/redis:7.4-alpine "$REDIS_TAG"
        return 0
    fi
    log "no registry: Debian's redis-server on the base image"
    mkdir -p "$WORK/redis-context"
    timeout 900 "$ENGINE" build -q -f scripts/redis.Dockerfile --build-arg "BASE_IMAGE=$BASE_TAG" \
        -t "$REDIS_TAG" "$WORK/redis-context" >"$WORK/redis-build.log" 2>&1 \
        || { tail -20 "$WORK/redis-build.log" >&2; die "building the Redis image failed"; }
}

make_tandem() {
    local old new args=()
    old=$(timeout 60 "$ENGINE" image inspect --format '{{.Id}}' "$IMAGE_TAG" 2>/dev/null || true)
    "$PY" scripts/container_build_env.py "$WORK/build-env" >/dev/null
    if [ "$ENGINE" = podman ]; then
        mapfile -t args <"$WORK/build-env/build-args"
    else
        # docker build cannot mount host paths: the registries' defaults, the TORCH_INDEX_URL
        # decision alone.
        args=(--build-arg "$(grep '^TORCH_INDEX_URL=' "$WORK/build-env/build-args")")
    fi
    log "building $IMAGE_TAG (BASE_IMAGE=$BASE_TAG)"
    local t
    t=$(date +%s)
    [ "$ENGINE" = podman ] && args+=(--layers)
    timeout 1800 "$ENGINE" build "${args[@]}" \
        --build-arg "BASE_IMAGE=$BASE_TAG" -t "$IMAGE_TAG" . >"$WORK/build.log" 2>&1 \
        || { tail -40 "$WORK/build.log" >&2; die "building the tandem image failed"; }
    new=$(timeout 60 "$ENGINE" image inspect --format '{{.Id}}' "$IMAGE_TAG")
    BUILD_S=$(($(date +%s) - t))
    # The image this one replaced is no cache of anything: remove it.
    if [ -n "$old" ] && [ "$old" != "$new" ]; then
        timeout 120 "$ENGINE" rmi "$old" >/dev/null 2>&1 || true
    fi
    IMAGE_SIZE=$(timeout 60 "$ENGINE" image inspect --format '{{.Size}}' "$IMAGE_TAG")
    log "built in ${BUILD_S}s, $((IMAGE_SIZE / 1000000)) MB ($(grep -c 'Using cache' "$WORK/build.log" || true) steps from the layer cache)"
}

make_base
make_redis
make_tandem

# ------------------------------------------------------------------------------- up
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
HTTP_PORT_NUM=$(free_port)
GRPC_PORT_NUM=$(free_port)
export TANDEM_IMAGE=$IMAGE_TAG REDIS_IMAGE=$REDIS_TAG
# float32: the workload checks greedy parity with an offline float32 run (bf16 results depend
# on batch shapes).
export PREFILL_REPLICAS=2 DECODE_REPLICAS=2 WORKER_THREADS=1 DTYPE=float32
export HTTP_PORT=127.0.0.1:$HTTP_PORT_NUM GRPC_PORT=127.0.0.1:$GRPC_PORT_NUM
export MAX_MODEL_LEN=2048 NUM_GPU_BLOCKS=256 GRACE_PERIOD_S=5 STOP_GRACE_PERIOD=10s
export WORKER_SHM_SIZE=${WORKER_SHM_SIZE:-1gb}

log "compose up (2 prefill, 2 decode replicas; frontend on 127.0.0.1:$HTTP_PORT_NUM)"
UP_AT=$(date +%s.%N)
UP=1
compose up -d --no-build >"$WORK/up.log" 2>&1 || { tail -40 "$WORK/up.log" >&2; die "compose up failed"; }
n=$(timeout 60 "$ENGINE" ps -q --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
[ "$n" -eq 7 ] || die "expected 7 containers running (redis, scheduler, frontend, 2+2 workers), found $n"

# ------------------------------------------------------------------------------- workload
log "workload"
PYTHONPATH=$ROOT timeout $((READY_TIMEOUT_S + 600)) "$PY" -m tests.deploy.compose_e2e_workload \
    --engine "$ENGINE" --project "$PROJECT" --http "127.0.0.1:$HTTP_PORT_NUM" --replicas 2 \
    --started-at "$UP_AT" --ready-timeout-s "$READY_TIMEOUT_S" | tee "$WORK/workload.out"
FIGURES=$(tail -1 "$WORK/workload.out")

# ------------------------------------------------------------------------------- down
log "compose down"
record_volumes
COMPOSE_TIMEOUT_S=180 compose down -v -t 10 >"$WORK/down.log" 2>&1 || { tail -20 "$WORK/down.log" >&2; die "compose down failed"; }
UP=0
# Anonymous volumes of the image's VOLUME (podman-compose's down keeps them).
for v in $(sort -u "$VOLUMES_FILE"); do
    timeout 60 "$ENGINE" volume rm -f "$v" >/dev/null 2>&1 || true
done
left=$(leftovers)
[ -z "$left" ] || die "compose down left behind: $left"
echo "compose_e2e: down ok (no containers, pod, networks or volumes left)"
echo "compose_e2e: passed in $(($(date +%s) - T0)) s; build ${BUILD_S} s; image $((IMAGE_SIZE / 1000000)) MB; $FIGURES"
