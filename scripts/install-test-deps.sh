#!/usr/bin/env bash
# Installs the tools the tests drive: Prometheus (and promtool) and Chromium for the
# observability tests, redis-server for the shared-state tests, nginx for the compose file's
# edge (tests/deploy), Node.js and npm for the JavaScript clients' tests, from Debian packages;
# then those clients (tests/node: the Vercel AI SDK), with `npm ci` from
# tests/node/package-lock.json. Idempotent: installs nothing that is already installed. Runs as
# root (CI, containers) or through sudo (the Debian packages).
set -euo pipefail
cd "$(dirname "$0")/.."

# The JavaScript clients, once Node.js is there: again when the lock file changed since.
install_node_clients() {
  local installed=tests/node/node_modules/.package-lock.json
  if [ -f "$installed" ] && [ "$installed" -nt tests/node/package-lock.json ]; then
    echo "install-test-deps: tests/node's npm packages already installed"
    return
  fi
  echo "install-test-deps: installing tests/node's npm packages (npm ci)"
  (cd tests/node && npm ci --no-audit --no-fund)
}

need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v nginx >/dev/null 2>&1 || need+=(nginx)
command -v node >/dev/null 2>&1 || need+=(nodejs)
command -v npm >/dev/null 2>&1 || need+=(npm)
if [ "${#need[@]}" -eq 0 ]; then
  echo "install-test-deps: prometheus, promtool, chromium, redis-server, nginx, node and npm already installed"
  install_node_clients
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
install_node_clients
