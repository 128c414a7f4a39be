#!/usr/bin/env bash
# Install Debian's redis-server when it is missing (the test suite starts its own servers).
# Idempotent and quiet: does nothing when redis-server is already on PATH.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install_redis.sh: redis-server is missing and we are not root (no sudo)" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
# The package may start a system service on 6379; the tests never use it.
command -v redis-server >/dev/null 2>&1 || {
    echo "install_redis.sh: redis-server still missing after apt-get install" >&2
    exit 1
}
