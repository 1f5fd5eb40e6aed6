#!/usr/bin/env bash
# Build a Python base image from Debian packages alone, for hosts that cannot pull from Docker
# Hub (air-gapped hosts, registries behind a proxy). Needs root, debootstrap and a Debian mirror
# (or a local mirror given as MIRROR). The image holds Debian's python3 (3.11 on bookworm) and a
# virtual environment at /opt/venv that comes first on PATH, so `pip install` works as in the
# official python images:
#   sudo bash docker/make-base-image.sh                 # -> image hogshard-python:3.11
#   docker build --build-arg PYTHON_IMAGE=hogshard-python:3.11 -f docker/Dockerfile ...
# Environment: IMAGE (tag, default hogshard-python:3.11), SUITE (default bookworm),
# MIRROR (default http://deb.debian.org/debian), EXTRA_CA_DIR (a folder of *.crt files added to
# the image's trust store, for TLS-intercepting proxies).
set -euo pipefail
IMAGE="${IMAGE:-hogshard-python:3.11}"
SUITE="${SUITE:-bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
EXTRA_CA_DIR="${EXTRA_CA_DIR:-}"

if docker image inspect "$IMAGE" >/dev/null 2>&1 && [ "${REBUILD:-0}" != 1 ]; then
  echo "$IMAGE exists (REBUILD=1 to make it again)" >&2
  exit 0
fi
command -v debootstrap >/dev/null || { echo "needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "needs root (debootstrap makes device nodes and chroots)" >&2; exit 1; }

root="$(mktemp -d /tmp/hogshard-rootfs.XXXXXX)"
trap 'rm -rf "$root"' EXIT
echo "debootstrap $SUITE from $MIRROR into $root ..." >&2
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  "$SUITE" "$root" "$MIRROR" >/tmp/hogshard-debootstrap.log 2>&1 || {
  tail -n 20 /tmp/hogshard-debootstrap.log >&2; exit 1; }
if [ -n "$EXTRA_CA_DIR" ]; then
  cp "$EXTRA_CA_DIR"/*.crt "$root/usr/local/share/ca-certificates/"
  chroot "$root" update-ca-certificates >/dev/null
fi
chroot "$root" python3 -m venv /opt/venv
# Trim what a runtime image does not need: apt lists, docs, man pages, locales.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* \
  "$root"/usr/share/man/* "$root"/usr/share/locale/*
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' - "$IMAGE" >/dev/null
echo "built $IMAGE ($(docker run --rm "$IMAGE" python --version))" >&2
