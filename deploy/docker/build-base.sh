#!/usr/bin/env bash
# Build a Debian bookworm base image without a container registry: debootstrap a minimal root file system from the
# Debian mirror the host's apt already uses, then `docker import` it as local/debian:bookworm. Only for hosts that
# reach a Debian mirror but no image registry; with a registry, use the default BASE (python:3.11-slim).
#   bash deploy/docker/build-base.sh [TAG]       (default local/debian:bookworm; idempotent: skips an existing tag)
set -euo pipefail
TAG="${1:-local/debian:bookworm}"
if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "[base] $TAG exists"; exit 0
fi
command -v debootstrap >/dev/null || { echo "[base] debootstrap missing: apt-get install debootstrap" >&2; exit 1; }
# The mirror apt uses here (deb822 .sources or one-line .list); deb.debian.org when neither names one.
MIRROR="$(grep -hoE '^URIs: *\S+' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' \
  | grep -v security | head -1 || true)"
if [ -z "$MIRROR" ]; then
  MIRROR="$(grep -hoE '^deb +\S+' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' | head -1 || true)"
fi
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
ROOTFS="$(mktemp -d /tmp/tessera-rootfs.XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT
echo "[base] debootstrap bookworm from $MIRROR"
debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" >/dev/null
# apt inside the image uses the same sources as the host (security updates included); no caches or lists shipped.
rm -f "$ROOTFS"/etc/apt/sources.list
mkdir -p "$ROOTFS"/etc/apt/sources.list.d
cp /etc/apt/sources.list.d/*.sources "$ROOTFS"/etc/apt/sources.list.d/ 2>/dev/null \
  || cp /etc/apt/sources.list "$ROOTFS"/etc/apt/sources.list
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*
tar -C "$ROOTFS" -c . | docker import -c 'CMD ["/bin/bash"]' -c 'ENV LANG=C.UTF-8' - "$TAG" >/dev/null
echo "[base] built $TAG"
