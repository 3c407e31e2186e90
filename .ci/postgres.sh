#!/usr/bin/env bash
# Starts a real PostgreSQL server on loopback for the batch-store contract tests and prints the line to export:
#   eval "$(.ci/postgres.sh)"   # sets LLM_LANES_TEST_POSTGRES_URL
# Idempotent: installs Debian's postgresql only if missing, reuses a running cluster, (re)sets the test role's
# password, creates the database only once. Works as root on a fresh Debian 12 with no systemd (pg_ctlcluster
# starts the server directly when systemd is not PID 1). Everything but the export line goes to stderr.
set -euo pipefail

DB_NAME="${LLM_LANES_PG_DB:-llm_lanes_test}"
DB_USER="${LLM_LANES_PG_USER:-llm_lanes}"
DB_PASSWORD="${LLM_LANES_PG_PASSWORD:-llm_lanes_test_pw}"
CLUSTER="${LLM_LANES_PG_CLUSTER:-main}"

log() { echo "[postgres.sh] $*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
  log "run as root (it installs packages and starts the server as the postgres user)"
  exit 1
fi

if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || ! command -v pg_ctlcluster >/dev/null 2>&1; then
  log "installing Debian's postgresql"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq postgresql >&2
fi

VERSION="$(ls /usr/lib/postgresql | sort -V | tail -n 1)"

if ! pg_lsclusters -h | awk -v v="$VERSION" -v c="$CLUSTER" '$1 == v && $2 == c {found=1} END {exit !found}'; then
  log "creating cluster $VERSION/$CLUSTER"
  # Loopback only: the test server must never listen on a public interface.
  pg_createcluster "$VERSION" "$CLUSTER" -o listen_addresses=127.0.0.1 >&2
fi

CONF_DIR="/etc/postgresql/$VERSION/$CLUSTER"
# Reused clusters may listen on 'localhost' (which can include ::1); pin to IPv4 loopback.
if ! grep -q "^listen_addresses = '127.0.0.1'" "$CONF_DIR/postgresql.conf"; then
  echo "listen_addresses = '127.0.0.1'" >> "$CONF_DIR/postgresql.conf"
fi

STATUS="$(pg_lsclusters -h | awk -v v="$VERSION" -v c="$CLUSTER" '$1 == v && $2 == c {print $4}')"
if [ "$STATUS" != "online" ]; then
  log "starting cluster $VERSION/$CLUSTER"
  pg_ctlcluster "$VERSION" "$CLUSTER" start >&2
fi
PORT="$(pg_lsclusters -h | awk -v v="$VERSION" -v c="$CLUSTER" '$1 == v && $2 == c {print $3}')"

# Wait until the server accepts connections (start-up can lag on a busy CI machine).
for _ in $(seq 1 60); do
  if su postgres -c "pg_isready -q -h 127.0.0.1 -p $PORT"; then break; fi
  sleep 0.5
done
su postgres -c "pg_isready -h 127.0.0.1 -p $PORT" >&2

psql_admin() { su postgres -c "psql -v ON_ERROR_STOP=1 -qAt -p $PORT $*"; }

if [ "$(psql_admin "-c \"SELECT 1 FROM pg_roles WHERE rolname = '$DB_USER'\"")" != "1" ]; then
  log "creating role $DB_USER"
  psql_admin "-c \"CREATE ROLE $DB_USER LOGIN PASSWORD '$DB_PASSWORD'\"" >&2
else
  psql_admin "-c \"ALTER ROLE $DB_USER LOGIN PASSWORD '$DB_PASSWORD'\"" >&2
fi
if [ "$(psql_admin "-c \"SELECT 1 FROM pg_database WHERE datname = '$DB_NAME'\"")" != "1" ]; then
  log "creating database $DB_NAME"
  psql_admin "-c \"CREATE DATABASE $DB_NAME OWNER $DB_USER\"" >&2
fi

log "PostgreSQL $VERSION on 127.0.0.1:$PORT, database $DB_NAME, user $DB_USER"
echo "export LLM_LANES_TEST_POSTGRES_URL=postgresql://$DB_USER:$DB_PASSWORD@127.0.0.1:$PORT/$DB_NAME"
