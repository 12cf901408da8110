#!/usr/bin/env bash
# Builds the image's base from Debian's packages, for an engine that cannot pull from an image
# registry (where `python:3.11-slim` is reachable, compose/Dockerfile's default needs none of this):
#
#   bash compose/base-image.sh [TAG]        # default tandem-base:bookworm; needs root and docker
#
# debootstrap lays a minimal Debian bookworm (Python 3.11, venv, CA certificates) from the mirror
# this machine's apt already uses, the docs and caches are dropped, and `docker import` turns the
# tree into an image. Idempotent: does nothing when TAG exists. About two minutes, 230 MB.
set -euo pipefail

tag="${1:-tandem-base:bookworm}"
suite="bookworm"

if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "base-image: $tag exists" >&2
    exit 0
fi

# The first Debian archive named in apt's sources (deb822 `URIs:` or one-line `deb URI`).
apt_mirror() {
    local line
    line="$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ {print $2}' \
        | grep -v -- '-security' | head -1 || true)"
    if [[ -z "$line" ]]; then
        line="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
            | awk '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' \
            | grep -v -- '-security' | head -1 || true)"
    fi
    echo "${line:-http://deb.debian.org/debian}"
}

if ! command -v debootstrap >/dev/null; then
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null
fi

rootfs="$(mktemp -d)"
trap 'rm -rf "$rootfs"' EXIT
mirror="$(apt_mirror)"
echo "base-image: debootstrap $suite from $mirror" >&2
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$suite" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || {
    tail -20 "$rootfs.log" >&2
    exit 1
}
rm -f "$rootfs.log"
# What an image never reads: package lists and caches, documentation, translations.
rm -rf "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
    "$rootfs"/usr/share/locale/*
tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$tag" >/dev/null
echo "base-image: $tag $(docker run --rm "$tag" python3 --version)" >&2
