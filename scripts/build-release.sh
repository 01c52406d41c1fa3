#!/usr/bin/env bash
# Build cmd/processor of an earlier release from this repository's own history:
#
#   scripts/build-release.sh <commit> <out-binary>
#
# The commit's tree is exported (git archive: no worktree is registered, nothing in the working
# tree is touched) into a temporary directory and built there with that tree's own go.mod and
# go.sum, so the binary is the release's, whatever this checkout holds. Modules come through the
# configured GOPROXY/GOFLAGS (the module cache usually has them already). -trimpath and an empty
# build id keep the build reproducible. `make chaos-upgrade` uses it for the release before
# (f433fb8).
set -euo pipefail

if [[ $# -ne 2 ]]; then
	echo "usage: $0 <commit> <out-binary>" >&2
	exit 2
fi
commit=$1
out=$2
cd "$(dirname "$0")/.."

if [[ "$(git cat-file -t "$commit" 2>/dev/null)" != commit ]]; then
	echo "build-release: commit $commit is not in this clone's history." >&2
	if [[ "$(git rev-parse --is-shallow-repository 2>/dev/null)" == true ]]; then
		echo "build-release: the clone is shallow: fetch the full history (git fetch --unshallow)." >&2
	else
		echo "build-release: fetch it (git fetch origin) or check the commit id." >&2
	fi
	exit 1
fi
full=$(git rev-parse "$commit^{commit}")

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kafkapg-release-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
git archive --format=tar "$full" | tar -x -C "$tmp"

mkdir -p "$(dirname "$out")"
out_abs="$(cd "$(dirname "$out")" && pwd)/$(basename "$out")"
(cd "$tmp" && go build -trimpath -ldflags=-buildid= -o "$out_abs" ./cmd/processor)
echo "build-release: $out built from ${full:0:12} ($(git log -1 --format=%cs "$full"))"
