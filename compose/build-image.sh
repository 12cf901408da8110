#!/usr/bin/env bash
# Builds the CPU image tandem:cpu where the engine has no image registry and PyTorch's CPU index
# is out of reach, from what this machine's package managers do reach:
#
#   bash compose/docker-engine.sh bash compose/build-image.sh     # or with an engine at hand
#
# 1. compose/base-image.sh: the base image from Debian's packages (skipped when it exists).
# 2. compose/build-extras/: torch's CPU wheel as this machine's pip finds it (`pip download`,
#    kept between builds) and the CA bundle named by pip's `cert` setting (PIP_CERT or pip
#    config), which the build's pip needs to reach the index.
# 3. `docker compose build prepare` with BASE_IMAGE set, so the image is the one
#    docker-compose.yml runs: every service shares it, and compose without buildx would build and
#    export it once per service. Layers are cached by the engine: a change of source rebuilds only
#    the last ones.
# Extra arguments go to `docker compose build` (e.g. --progress plain).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
extras="compose/build-extras"
base="${BASE_IMAGE:-tandem-base:bookworm}"

bash compose/base-image.sh "$base"

torch_pin="$(python3 -c 'import tomllib; print(next(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if d.startswith("torch==")))')"
mkdir -p "$extras/wheels"
if ! ls "$extras"/wheels/torch-*+cpu-*.whl >/dev/null 2>&1; then
    echo "build-image: pip download $torch_pin" >&2
    python3 -m pip download -q --no-deps "$torch_pin" -d "$extras/wheels"
    if ! ls "$extras"/wheels/torch-*+cpu-*.whl >/dev/null 2>&1; then
        echo "build-image: pip found no CPU wheel for $torch_pin; the build would take PyPI's" \
            "CUDA wheel. Put torch's CPU wheel in $extras/wheels/." >&2
        exit 1
    fi
fi

cert="${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}"
if [[ -n "$cert" && -f "$cert" ]]; then
    cp "$cert" "$extras/pip-cert.pem"
else
    rm -f "$extras/pip-cert.pem"
fi

BASE_IMAGE="$base" docker compose build "$@" prepare
docker image ls "tandem:${VARIANT:-cpu}" --format 'build-image: {{.Repository}}:{{.Tag}} {{.Size}}' >&2
