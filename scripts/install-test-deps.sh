#!/usr/bin/env bash
# Installs the system tools the tests drive: Prometheus (and promtool) and Chromium for the
# observability tests, redis-server for the shared-state tests, from Debian packages. Idempotent: does nothing when they are already installed.
# Runs as root (CI, containers) or through sudo.
set -euo pipefail

need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
if [ "${#need[@]}" -eq 0 ]; then
  echo "install-test-deps: prometheus, promtool, chromium and redis-server already installed"
  exit 0
fi
# Unique package names, in order.
mapfile -t packages < <(printf '%s\n' "${need[@]}" | awk '!seen[$0]++')

as_root=()
if [ "$(id -u)" -ne 0 ]; then
  as_root=(sudo)
fi
echo "install-test-deps: installing ${packages[*]}"
"${as_root[@]}" apt-get update -q
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
  "${packages[@]}"
