#!/usr/bin/env bash
# A base image for sandbox/Containerfile made from Debian's packages, for machines that reach apt's mirror but no
# container registry (CI): bookworm's minbase (util-linux's `unshare` included) plus python3 (3.11) and
# python3-venv. Prints its tag on stdout; the rest goes to stderr. Needs root, mmdebstrap and the engine.
#
#   sandbox/make-base.sh [--tag TAG] [--engine podman|docker]      then: sandbox/build-image.sh --base TAG
#
# $ENGINE_ARGS: extra global arguments of the engine, as for build-image.sh.
set -euo pipefail

usage="usage: make-base.sh [--tag TAG] [--engine podman|docker]"
tag=localhost/stare-sandbox-base:latest
engine=podman
value() { [[ $# -ge 2 ]] || { echo "make-base.sh: $1 needs a value; $usage" >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --tag) value "$@"; tag=$2; shift 2 ;;
        --engine) value "$@"; engine=$2; shift 2 ;;
        *) echo "make-base.sh: unknown argument '$1'; $usage" >&2; exit 2 ;;
    esac
done
for tool in mmdebstrap "$engine"; do
    if ! command -v "$tool" >/dev/null; then
        echo "make-base.sh: $tool is not installed (apt-get install mmdebstrap podman runc)" >&2
        exit 1
    fi
done

dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# no mirror named: deb.debian.org with bookworm-updates and bookworm-security, so the image gets security fixes
mmdebstrap --quiet --variant=minbase --include=python3,python3-venv bookworm "$dir/rootfs.tar" >&2
# shellcheck disable=SC2086  # ENGINE_ARGS is a list of words
"$engine" ${ENGINE_ARGS:-} import "$dir/rootfs.tar" "$tag" >&2
echo "$tag"
