#!/usr/bin/env bash
# Production on one machine, without Docker: PostgreSQL in a folder of its own, an MLflow tracking server and a
# Prefect server on it, all on 127.0.0.1 (infra/docker-compose.yml is the same stack in containers).
#
#   infra/local-production.sh start DIR   # prints the environment to use, e.g. eval "$(infra/... start DIR)"
#   infra/local-production.sh stop DIR    # stops the three (the data stays in DIR for the next start)
# `start` starts what is not running, so after one of the three died it brings that one back (runs keep going:
# MLflow values sent meanwhile are retried, Prefect's client waits for its server).
#
# Needs PostgreSQL's server binaries (Debian: postgresql-15; PG_BIN names their folder) and the project's
# `postgres` extra (psycopg2 for MLflow, asyncpg for Prefect; .ci/install installs it). As root, PostgreSQL runs
# as the `postgres` user. Ports: PG_PORT (5433), MLFLOW_PORT (5000), PREFECT_PORT (4200).
set -euo pipefail
ACTION=${1:?usage: $0 start|stop DIR}
DIR=$(mkdir -p "${2:?usage: $0 start|stop DIR}" && cd "$2" && pwd)
PG_BIN=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)}
PG_PORT=${PG_PORT:-5433}
MLFLOW_PORT=${MLFLOW_PORT:-5000}
PREFECT_PORT=${PREFECT_PORT:-4200}
BIN=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

running() {  # NAME: its pid file names a live process
  [ -f "$DIR/run/$1.pid" ] && kill -0 "$(cat "$DIR/run/$1.pid")" 2>/dev/null
}

wait_for() {  # URL, name, log: up to 120 s
  for _ in $(seq 240); do
    if "$BIN/python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; then
      return 0
    fi
    sleep 0.5
  done
  echo "$2 did not answer at $1 within 120 s; see $3" >&2
  exit 1
}

case "$ACTION" in
start)
  [ -x "$PG_BIN/pg_ctl" ] || { echo "no PostgreSQL server binaries (set PG_BIN)" >&2; exit 1; }
  mkdir -p "$DIR/pgdata" "$DIR/run" "$DIR/mlartifacts"
  [ "$(id -u)" = 0 ] && chown postgres "$DIR/pgdata" "$DIR/run"
  if ! as_pg test -w "$DIR/pgdata"; then
    echo "the postgres user cannot write $DIR/pgdata (a parent folder is private?): give a folder it can reach" >&2
    exit 1
  fi
  if [ ! -f "$DIR/pgdata/PG_VERSION" ]; then
    as_pg "$PG_BIN/initdb" -D "$DIR/pgdata" -U postgres --auth=trust >"$DIR/initdb.log" 2>&1 \
      || { echo "initdb failed; see $DIR/initdb.log" >&2; exit 1; }
  fi
  if ! as_pg "$PG_BIN/pg_ctl" -D "$DIR/pgdata" status >/dev/null 2>&1; then
    as_pg "$PG_BIN/pg_ctl" -D "$DIR/pgdata" -l "$DIR/run/postgres.log" -w start \
      -o "-p $PG_PORT -k $DIR/run -c listen_addresses=127.0.0.1" >/dev/null \
      || { echo "PostgreSQL did not start; see $DIR/run/postgres.log" >&2; exit 1; }
  fi
  for db in mlflow prefect; do
    as_pg "$PG_BIN/psql" -h 127.0.0.1 -p "$PG_PORT" -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='$db'" \
      | grep -q 1 || as_pg "$PG_BIN/createdb" -h 127.0.0.1 -p "$PG_PORT" -U postgres "$db"
  done
  PG=postgres@127.0.0.1:$PG_PORT
  if ! running mlflow; then
    MLFLOW_DISABLE_TELEMETRY=true setsid "$BIN/mlflow" server --backend-store-uri "postgresql://$PG/mlflow" \
      --artifacts-destination "$DIR/mlartifacts" --host 127.0.0.1 --port "$MLFLOW_PORT" \
      >>"$DIR/run/mlflow.log" 2>&1 < /dev/null &
    echo $! > "$DIR/run/mlflow.pid"
  fi
  if ! running prefect; then
    PREFECT_API_DATABASE_CONNECTION_URL="postgresql+asyncpg://$PG/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false \
      PREFECT_HOME="$DIR/prefect-home" setsid "$BIN/prefect" server start --host 127.0.0.1 --port "$PREFECT_PORT" \
      >>"$DIR/run/prefect.log" 2>&1 < /dev/null &
    echo $! > "$DIR/run/prefect.pid"
  fi
  wait_for "http://127.0.0.1:$MLFLOW_PORT/health" "mlflow server" "$DIR/run/mlflow.log"
  wait_for "http://127.0.0.1:$PREFECT_PORT/api/health" "prefect server" "$DIR/run/prefect.log"
  echo "export MLFLOW_TRACKING_URI=http://127.0.0.1:$MLFLOW_PORT"
  echo "export PREFECT_API_URL=http://127.0.0.1:$PREFECT_PORT/api"
  ;;
stop)
  for name in prefect mlflow; do
    if [ -f "$DIR/run/$name.pid" ]; then
      pid=$(cat "$DIR/run/$name.pid")
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -KILL -- "-$pid" 2>/dev/null || true
      rm -f "$DIR/run/$name.pid"
    fi
  done
  if [ -f "$DIR/pgdata/postmaster.pid" ]; then
    as_pg "$PG_BIN/pg_ctl" -D "$DIR/pgdata" -m fast -w stop >/dev/null
  fi
  ;;
*)
  echo "usage: $0 start|stop DIR" >&2
  exit 2
  ;;
esac
