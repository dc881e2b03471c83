#!/usr/bin/env bash
# Make sure the local Postgres, Redis and RabbitMQ answer on their standard ports;
# start any that does not, and wait (bounded) until it does.
set -uo pipefail

PG_PORT=5432
REDIS_PORT=6379
AMQP_PORT=5672
WAIT_SECONDS=${SERVICES_WAIT_SECONDS:-90}

pg_up() { pg_isready -h 127.0.0.1 -p "$PG_PORT" -q; }
redis_up() { [ "$(redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null)" = "PONG" ]; }
# An accepted TCP connection is not enough: a broker that is booting, or out of sockets,
# accepts and then never speaks. Ready means it answers the AMQP 0-9-1 protocol header
# with a frame (its first byte is 1, a method frame: connection.start).
amqp_tcp() { timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$AMQP_PORT" 2>/dev/null; }
amqp_up() {
  [ "$(timeout 5 bash -c "exec 3<>/dev/tcp/127.0.0.1/$AMQP_PORT && printf 'AMQP\\0\\0\\011\\01' >&3 && head -c 1 <&3" 2>/dev/null |
    od -An -tx1 | tr -d ' ')" = "01" ]
}

start_postgres() {
  service postgresql start >/dev/null 2>&1 && return 0
  for cluster in /etc/postgresql/*/main; do
    pg_ctlcluster "$(basename "$(dirname "$cluster")")" main start && return 0
  done
  return 1
}
start_redis() {
  service redis-server start >/dev/null 2>&1 && redis_up && return 0
  redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --daemonize yes >/dev/null
}
start_rabbitmq() {
  if amqp_tcp; then
    # The node is up but its AMQP side does not answer: give a booting broker a minute,
    # then restart the application inside the node.
    local deadline=$((SECONDS + 60))
    while [ "$SECONDS" -lt "$deadline" ]; do amqp_up && return 0; sleep 2; done
    echo "services: RabbitMQ accepts connections but does not answer AMQP; restarting its application"
    timeout 120 rabbitmqctl stop_app >/dev/null && timeout 300 rabbitmqctl start_app >/dev/null && return 0
    return 1
  fi
  service rabbitmq-server start >/dev/null 2>&1 && return 0
  rabbitmq-server -detached
}

ensure() {
  local name=$1 probe=$2 starter=$3
  if $probe; then
    echo "services: $name answers"
    return 0
  fi
  echo "services: $name does not answer; starting it"
  $starter || echo "services: starting $name returned an error; waiting anyway" >&2
  local deadline=$((SECONDS + WAIT_SECONDS))
  until $probe; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "services: $name is still down after ${WAIT_SECONDS}s" >&2
      return 1
    fi
    sleep 1
  done
  echo "services: $name is up"
}

status=0
ensure Postgres pg_up start_postgres || status=1
ensure Redis redis_up start_redis || status=1
ensure RabbitMQ amqp_up start_rabbitmq || status=1
if [ "$status" -eq 0 ] && ! psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -tAc \
    "SELECT 1 FROM pg_database WHERE datname = 'test'" | grep -q 1; then
  echo "services: creating database 'test' for the test suite"
  createdb -h 127.0.0.1 -p "$PG_PORT" -U postgres test || status=1
fi
exit $status
