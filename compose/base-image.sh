#!/bin/sh
# Make a Debian base image without any registry: debootstrap a minimal bookworm from the Debian
# mirror apt already uses, then `docker import` it. Skips the work when the image exists.
#
#   compose/base-image.sh [TAG]        (default pdserve-base:bookworm; MIRROR= to choose a mirror)
#
# Needs root, debootstrap and a running docker engine. Takes about a minute; about 130 MB.
set -eu
tag="${1:-pdserve-base:bookworm}"
suite="${SUITE:-bookworm}"
if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "base image $tag exists"
    exit 0
fi
if [ -z "${MIRROR:-}" ]; then
    # The first Debian mirror apt is configured with (deb822 or one-line sources).
    MIRROR=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
        /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | sed -n -e 's/^URIs: *\([^ ]*\/debian\)\/*$/\1/p' \
              -e 's/^deb  *\(\[[^]]*\] *\)\{0,1\}\([^ ]*\/debian\)\/* .*/\2/p' | head -n 1)
    MIRROR="${MIRROR:-http://deb.debian.org/debian}"
fi
rootfs=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-rootfs.XXXXXX")
trap 'rm -rf "$rootfs"' EXIT
echo "debootstrap $suite from $MIRROR"
debootstrap --variant=minbase "$suite" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 \
    || { cat "$rootfs.log"; rm -f "$rootfs.log"; exit 1; }
rm -f "$rootfs.log"
# The package lists and downloaded .debs are stale the moment the image exists.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*
tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$tag"
echo "base image $tag made"
