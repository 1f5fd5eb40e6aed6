#!/usr/bin/env bash
# Make this host ready for the compose system test (tests/system), as root on Debian: install
# Debian's docker.io, docker-compose and debootstrap if absent, start dockerd if none answers,
# make a Python base image from Debian packages when python:3.11-slim cannot be had (no Docker
# Hub), and fill docker/wheelhouse/ so the image builds need no network. Prints the environment
# the system test needs (eval it, or source the file it writes: .docker-env).
set -euo pipefail
cd "$(dirname "$0")/.."
log=/tmp/hogshard-docker-setup.log
: > "$log"

# An install cut short leaves packages unpacked but not configured (dpkg --audit lists them):
# iptables then has no command, docker cannot set up its embedded DNS in a container, and no
# compose service resolves another's name. Finish such a run first.
if [ -n "$(dpkg --audit 2>/dev/null)" ]; then
  echo "docker-setup: finishing an interrupted dpkg run (dpkg --configure -a)" >&2
  DEBIAN_FRONTEND=noninteractive dpkg --configure -a >>"$log" 2>&1
fi
need=()
command -v iptables >/dev/null || need+=(iptables)
command -v dockerd >/dev/null || need+=(docker.io)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  echo "docker-setup: apt-get install ${need[*]}" >&2
  apt-get update -q >>"$log" 2>&1
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >>"$log" 2>&1
fi

if ! docker info >/dev/null 2>&1; then
  echo "docker-setup: starting dockerd" >&2
  # No iptables and no default bridge: the sandboxes this runs in allow neither; compose's own
  # networks still join the containers of a project.
  nohup dockerd --iptables=false --bridge=none >/tmp/hogshard-dockerd.log 2>&1 &
  for _ in $(seq 1 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { tail -n 20 /tmp/hogshard-dockerd.log >&2; exit 1; }
fi

base="${HOGSHARD_PYTHON_IMAGE:-}"
if [ -z "$base" ]; then
  if docker image inspect python:3.11-slim >/dev/null 2>&1 \
      || timeout 120 docker pull -q python:3.11-slim >>"$log" 2>&1; then
    base=python:3.11-slim
  else
    echo "docker-setup: no python:3.11-slim (no Docker Hub): making one from Debian packages" >&2
    bash docker/make-base-image.sh
    base=hogshard-python:3.11
  fi
fi

stamp=docker/wheelhouse/.stamp
want="$(cat setup.cfg pyproject.toml docker/make-wheelhouse.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "docker-setup: filling docker/wheelhouse/" >&2
  PYTHON="${PYTHON:-python3}" bash docker/make-wheelhouse.sh
  echo "$want" > "$stamp"
fi

cat > .docker-env <<ENV
export HOGSHARD_PYTHON_IMAGE=$base
export HOGSHARD_PIP_ARGS=--no-index
ENV
cat .docker-env
