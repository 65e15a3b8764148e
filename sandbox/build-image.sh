#!/usr/bin/env bash
# Build the sandbox service's image (sandbox/Containerfile) and print its tag on stdout; the rest goes to stderr.
#
#   sandbox/build-image.sh [--base IMAGE] [--tag TAG] [--engine podman|docker]
#
# The build context is a temp dir holding only wheels of stare-sandbox and its dependencies, built here by
# $PYTHON (default python3) from a copy of sandbox/: nothing of the trainer reaches the image, and the build needs
# no network. Binary wheels (numpy's) fit one Python minor version, so $PYTHON must be the base image's version:
# 3.11 for the default python:3.11-slim and for make-base.sh's Debian bookworm base (the build says so otherwise).
# $ENGINE_ARGS: extra global arguments of the engine, e.g. "--runtime runc" (podman on hybrid cgroups).
set -euo pipefail

usage="usage: build-image.sh [--base IMAGE] [--tag TAG] [--engine podman|docker]"
here=$(cd "$(dirname "$0")" && pwd)
base=docker.io/library/python:3.11-slim
engine=podman
tag=
value() { [[ $# -ge 2 ]] || { echo "build-image.sh: $1 needs a value; $usage" >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --base) value "$@"; base=$2; shift 2 ;;
        --tag) value "$@"; tag=$2; shift 2 ;;
        --engine) value "$@"; engine=$2; shift 2 ;;
        *) echo "build-image.sh: unknown argument '$1'; $usage" >&2; exit 2 ;;
    esac
done
case $engine in
    podman) tag=${tag:-localhost/stare-sandbox:latest}; format=(--format docker) ;;  # keeps the HEALTHCHECK
    docker) tag=${tag:-stare-sandbox:latest}; format=() ;;
    *) echo "build-image.sh: --engine must be podman or docker; got '$engine'" >&2; exit 2 ;;
esac
if ! command -v "$engine" >/dev/null; then
    echo "build-image.sh: $engine is not installed (apt-get install podman runc, or --engine docker)" >&2
    exit 1
fi

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
mkdir "$ctx/src"
cp -r "$here/pyproject.toml" "$here/stare_sandbox" "$ctx/src/"  # a copy: no build/ left behind in sandbox/
"${PYTHON:-python3}" -m pip wheel --quiet --disable-pip-version-check "$ctx/src" -w "$ctx/wheels" >&2
cp "$here/Containerfile" "$ctx/"
# shellcheck disable=SC2086  # ENGINE_ARGS is a list of words
{
    old=$("$engine" ${ENGINE_ARGS:-} image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
    "$engine" ${ENGINE_ARGS:-} build "${format[@]}" --network none --build-arg "BASE=$base" -t "$tag" \
        -f "$ctx/Containerfile" "$ctx"
    # the image this one replaces (hundreds of MB; rebuilt by every test session) unless a container still uses it
    new=$("$engine" ${ENGINE_ARGS:-} image inspect --format '{{.Id}}' "$tag")
    if [[ -n $old && $old != "$new" ]]; then "$engine" ${ENGINE_ARGS:-} rmi "$old" 2>/dev/null || true; fi
} >&2
echo "$tag"
