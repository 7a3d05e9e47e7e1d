#!/usr/bin/env bash
# The benchmark harness, one command, from a clean checkout:
#
#     bash bench/run.sh                 # full run (~16 min), rewrites bench/RESULTS.md
#     bash bench/run.sh --quick         # smoke test (~3 min), same tables, short runs
#     bash bench/run.sh --only a,b      # some scenarios; --out FILE to write elsewhere
#
# It installs what is missing, then runs `python -m bench.harness` (see its docstring
# for the scenarios and the core pinning):
#   - Debian: nginx, libnginx-mod-http-echo, wrk (apt-get; needs root or sudo)
#   - bourse in .venv (as `bash scripts/test` makes it)
#   - LiteLLM proxy in its own venv: bench/.work/litellm-venv (pip install 'litellm[proxy]')
#   - Portkey's gateway from npm (@portkey-ai/gateway) in bench/.work/portkey
# A peer that does not install is recorded in bench/.work/<peer>.status and reported
# in RESULTS.md as "not installed: <reason>"; the run goes on without it.
# PostgreSQL for scenario (f): 127.0.0.1:5432, user postgres, database test
# (BOURSE_TEST_POSTGRES_URL overrides); unreachable -> that row says "not run".
# Scenario (i) makes a database of its own on that server (BOURSE_DISK_POSTGRES_URL
# overrides; its pg_walinspect extension is PostgreSQL's contrib, 15 or later).
# Scenario (j) does the same (BOURSE_DISK_POSTGRES_URL), and starts a Redis server of its
# own (redis-server on a free loopback port; without it, the shared 127.0.0.1:6379).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=bench/.work
mkdir -p "$WORK"
say() { echo "[bench/run.sh] $*" >&2; }
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

# 1. Debian packages
need=()
command -v nginx >/dev/null 2>&1 || need+=(nginx)
[ -e /usr/lib/nginx/modules/ngx_http_echo_module.so ] || need+=(libnginx-mod-http-echo)
command -v wrk >/dev/null 2>&1 || need+=(wrk)
command -v taskset >/dev/null 2>&1 || need+=(util-linux)
if [ ${#need[@]} -gt 0 ]; then
  say "apt-get install ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >"$WORK/apt.log" 2>&1 \
    || { say "apt-get failed, see $WORK/apt.log"; tail -5 "$WORK/apt.log" >&2; exit 1; }
fi

# 2. bourse
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c 'import bourse, httpx, psycopg, redis' >/dev/null 2>&1; then
  say "installing bourse into .venv"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
fi

# 3. LiteLLM proxy, in its own venv
LV="$WORK/litellm-venv"
rm -f "$WORK/litellm.status"
if [ ! -x "$LV/bin/litellm" ]; then
  say "installing LiteLLM proxy into $LV (takes a few minutes)"
  if ! { "$PYTHON" -m venv "$LV" && "$LV/bin/python" -m pip install -q --disable-pip-version-check 'litellm[proxy]'; } \
      >"$WORK/litellm-install.log" 2>&1; then
    echo "not installed: pip install 'litellm[proxy]' failed: $(grep -v '^WARNING' "$WORK/litellm-install.log" | tail -2 | tr '\n' ' ')" >"$WORK/litellm.status"
    say "$(cat "$WORK/litellm.status")"
  fi
fi

# 4. Portkey gateway, from npm
PK="$WORK/portkey"
rm -f "$WORK/portkey.status"
if [ ! -f "$PK/node_modules/@portkey-ai/gateway/build/start-server.js" ]; then
  if ! command -v npm >/dev/null 2>&1 || ! command -v node >/dev/null 2>&1; then
    say "apt-get install nodejs npm (for Portkey)"
    { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nodejs npm; } \
      >>"$WORK/apt.log" 2>&1 || true
  fi
  if command -v npm >/dev/null 2>&1; then
    say "installing @portkey-ai/gateway into $PK"
    mkdir -p "$PK"
    if ! ( cd "$PK" && { [ -f package.json ] || npm init -y >/dev/null; } \
           && npm install --no-audit --no-fund @portkey-ai/gateway ) >"$WORK/portkey-install.log" 2>&1; then
      echo "not installed: npm install @portkey-ai/gateway failed: $(tail -2 "$WORK/portkey-install.log" | tr '\n' ' ')" >"$WORK/portkey.status"
    fi
  else
    echo "not installed: node/npm are not available (apt-get install nodejs npm failed)" >"$WORK/portkey.status"
  fi
  [ -f "$WORK/portkey.status" ] && say "$(cat "$WORK/portkey.status")"
fi

# 5. 10,000 streams need file descriptors (gateway: client + upstream sockets)
ulimit -Hn 65536 2>/dev/null || true
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

exec .venv/bin/python -m bench.harness "$@"
