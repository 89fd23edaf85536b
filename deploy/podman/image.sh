#!/usr/bin/env bash
# Build vision-serve's images with podman where no container registry is reachable: the base is made
# here from Debian packages. The image's reference is printed last, alone on its line.
#
#   deploy/podman/image.sh base [podman build flags]  make the Debian + Python base, if it is missing
#   deploy/podman/image.sh cpu  [podman build flags]  the CPU image (Dockerfile); `make image` runs this
#   deploy/podman/image.sh gpu  [podman build flags]  Dockerfile.gpu on a stand-in for its NGC base
#
# A rebuild removes the image its tag named before, once no tag names it (a container made from it keeps it).
#
# Environment:
#   BASE_IMAGE       the CPU image's base; default: the local Debian base (made when missing). Where a
#                    registry is reachable: BASE_IMAGE=docker.io/library/python:3.12-slim-bookworm
#   TORCH_INDEX_URL  where torch comes from; default: PyTorch's CPU builds if that index answers, else
#                    the package index pip uses here (PyPI's torch carries CUDA's libraries: several GB)
#   DEBIAN_SOURCES   apt sources for the base (a sources file or "deb URI SUITE main"); default: the
#                    Debian sources this machine's apt uses
#   PIP_CERT         a CA bundle pip needs to reach its index (a TLS-intercepting proxy); mounted into
#                    the build read-only, never copied into a layer. Default: pip's own `cert` setting
#   CONTAINERS_CONF  podman's settings; default: deploy/podman/containers.conf (runc, open-files limit)
set -euo pipefail
cd "$(dirname "$0")/../.."

say() { printf 'image: %s\n' "$*" >&2; }
die() {
	say "$*"
	exit 1
}

kind=${1:-}
[[ $kind == base || $kind == cpu || $kind == gpu ]] || die "usage: deploy/podman/image.sh base|cpu|gpu [podman build flags]"
shift

command -v podman >/dev/null ||
	die "podman is not installed: apt-get install podman runc (and mmdebstrap for the base), or build with docker (docs/deployment.md)."
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/deploy/podman/containers.conf}

LOCAL_BASE=localhost/debian-python:bookworm
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)
[[ -n $version ]] || die "cannot read the project's version from pyproject.toml"

elapsed() { echo $((SECONDS - $1)); }

debian_sources() {
	if [[ -n ${DEBIAN_SOURCES:-} ]]; then
		printf '%s\n' "$DEBIAN_SOURCES"
		return
	fi
	# The host's own Debian sources (its mirror or proxy), never a host name written into the repo.
	local file
	for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list; do
		[[ -f $file ]] && grep -Eq '^[^#]*(URIs:|deb ).*debian' "$file" && printf '%s\n' "$file"
	done
	return 0
}

make_base() {
	if podman image exists "$LOCAL_BASE"; then
		say "base $LOCAL_BASE is here"
		return
	fi
	command -v mmdebstrap >/dev/null || die "mmdebstrap is not installed (apt-get install mmdebstrap), or set BASE_IMAGE to a Python image you can pull."
	local -a sources=()
	mapfile -t sources < <(debian_sources)
	[[ ${#sources[@]} -gt 0 ]] || say "no Debian apt sources on this machine: mmdebstrap uses deb.debian.org"
	local work started=$SECONDS
	work=$(mktemp -d)
	# shellcheck disable=SC2064  # expand now: the trap must remove this folder even if work changes
	trap "rm -rf '$work'" RETURN
	say "making $LOCAL_BASE: Debian bookworm (minbase) + python3, from ${sources[*]:-deb.debian.org}"
	mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
		bookworm "$work/base.tar" "${sources[@]}" >&2
	# No /dev entries, as in registry images (the runtime provides /dev): podman copies the image's
	# /dev/shm (root, 0755) onto a volume mounted there, which a Kubernetes emptyDir at /dev/shm
	# (deploy/k8s) then could not be written by the image's user.
	tar --delete --wildcards --file "$work/base.tar" './dev/?*'
	podman import --quiet "$work/base.tar" "$LOCAL_BASE" >/dev/null
	say "made $LOCAL_BASE in $(elapsed "$started") s"
}

# Flags every build gets: the CA bundle pip needs here (mounted, not copied), docker format (OCI images
# drop HEALTHCHECK).
build_flags=(--format docker)
pip_cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
if [[ -n $pip_cert && -f $pip_cert ]]; then
	build_flags+=(--volume "$(realpath "$pip_cert"):/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt)
fi

torch_index() {
	if [[ -n ${TORCH_INDEX_URL:-} ]]; then
		printf '%s\n' "$TORCH_INDEX_URL"
	elif python3 -c 'import urllib.request as u; u.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=5)' 2>/dev/null; then
		printf '%s\n' https://download.pytorch.org/whl/cpu
	else
		say "PyTorch's CPU index is not reachable: torch comes from PyPI (CUDA's libraries included, several GB)"
		printf '%s\n' https://pypi.org/simple
	fi
}

# The image a tag named before this build: once the tag moves, nothing names it, and each rebuild would
# keep several GB more (its torch layer, when pyproject.toml changed) until someone prunes.
previous_image() { podman image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }
remove_if_untagged() {
	local id=$1
	[[ -n $id ]] && podman image exists "$id" || return 0
	[[ -z $(podman image inspect --format '{{join .RepoTags ""}}' "$id" 2>/dev/null) ]] || return 0
	# A container made from it keeps it (rmi refuses): that is the user's to remove.
	podman rmi "$id" >/dev/null 2>&1 && say "removed the previous build ${id:0:12}, which no tag names any more"
	return 0
}

build() { # build REFERENCE FILE [flags...]: build, say how long it took, print the reference last
	local ref=$1 file=$2 started=$SECONDS before
	shift 2
	before=$(previous_image "$ref")
	say "building $ref from $file"
	podman build "${build_flags[@]}" --file "$file" --tag "$ref" "$@" . >&2
	say "built $ref in $(elapsed "$started") s, $(podman image inspect --format '{{.Size}}' "$ref") bytes"
	[[ $before == "$(previous_image "$ref")" ]] || remove_if_untagged "$before"
	printf '%s\n' "$ref"
}

case $kind in
base)
	make_base
	printf '%s\n' "$LOCAL_BASE"
	;;
cpu)
	base=${BASE_IMAGE:-}
	if [[ -z $base ]]; then
		make_base
		base=$LOCAL_BASE
	fi
	build "localhost/vision-serve-cpu:$version" Dockerfile \
		--build-arg "BASE_IMAGE=$base" --build-arg "TORCH_INDEX_URL=$(torch_index)" "$@"
	;;
gpu)
	make_base
	# The GPU machine's torch and torchvision, as the GPU dry run's stand-in venv has them.
	torch=$(sed -n 's/^torch==//p' benchmarks/gpu/standin.txt)
	torchvision=$(sed -n 's/^torchvision==//p' benchmarks/gpu/standin.txt)
	standin=localhost/ngc-pytorch-standin:torch$torch
	build "$standin" deploy/podman/ngc-standin.Containerfile --build-arg "BASE_IMAGE=$LOCAL_BASE" \
		--build-arg "TORCH_VERSION=$torch" --build-arg "TORCHVISION_VERSION=$torchvision" >/dev/null
	build "localhost/vision-serve-gpu:$version-standin" Dockerfile.gpu --build-arg "BASE_IMAGE=$standin" "$@"
	;;
esac
