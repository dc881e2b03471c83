#!/usr/bin/env bash
# Build the image and run it for real against this machine's Postgres, Redis and RabbitMQ:
# it must get ready (/readyz, the HEALTHCHECK), process one event sent on both channels once,
# and stop cleanly on SIGTERM. Everything it makes (container, database, vhost, Redis data,
# image tag) is removed afterwards. Run by .ci/run after the tests.
#
# No Docker daemon is needed: Debian's podman builds and runs the image (as root, with runc and
# cgroupfs). Base images are not pulled: debian:bookworm-slim is made locally with debootstrap
# the first time. HTTPS during the build goes through this machine's CA bundle, mounted read-only
# with config files that point pip and uv at it; the Dockerfile itself is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "container-check: FAILED: $*" >&2; exit 1; }
say() { echo "container-check: $*"; }

run_id="$(date +%s)-$$"
name="ei-check-$run_id"
image="localhost/evolution-ingest:check-$run_id"
database="ei_check_${run_id//-/_}"
vhost="ei-check-$run_id"
redis_db=13
state=.tools/containers
mkdir -p "$state"

# --- podman --------------------------------------------------------------------------------
if ! command -v podman >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    say "installing podman, runc and debootstrap (Debian packages)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends podman runc debootstrap >/dev/null ||
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends podman runc debootstrap >/dev/null; } ||
      fail "podman is missing and could not be installed (apt-get install podman runc debootstrap)"
  else
    fail "podman is missing: install Debian's podman, runc and debootstrap (root needed here)"
  fi
fi
cat >"$state/containers.conf" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
export CONTAINERS_CONF="$PWD/$state/containers.conf"
if ! info=$(podman info 2>&1); then
  fail "podman cannot run on this machine: $(echo "$info" | tail -n 3)"
fi

# --- the base image, made locally ------------------------------------------------------------
# What makes the official image "slim", given to a debootstrapped root: dpkg leaves out docs, man
# pages and locales, and apt keeps no downloaded .deb (so the image's layers hold none).
slim_base() {
  local root=$1
  [ -n "$root" ] && [ "$root" != / ] && [ -d "$root/etc/apt" ] || fail "not a debootstrapped root: '$root'"
  printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
    'path-exclude /usr/share/man/*' 'path-exclude /usr/share/groff/*' 'path-exclude /usr/share/info/*' \
    'path-exclude /usr/share/locale/*' 'path-exclude /usr/share/lintian/*' >"$root/etc/dpkg/dpkg.cfg.d/docker"
  local clean='"rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"'
  printf '%s\n' "DPkg::Post-Invoke { $clean; };" "APT::Update::Post-Invoke { $clean; };" \
    'Dir::Cache::pkgcache "";' 'Dir::Cache::srcpkgcache "";' >"$root/etc/apt/apt.conf.d/docker-clean"
  find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  rm -rf "${root:?}"/usr/share/man/* "${root:?}"/usr/share/locale/* "${root:?}"/usr/share/info/*
  rm -rf "${root:?}"/var/cache/apt/archives/*.deb "${root:?}"/var/lib/apt/lists/*
}
if ! podman image exists debian:bookworm-slim; then
  command -v debootstrap >/dev/null || fail "debootstrap is missing (apt-get install debootstrap)"
  say "making debian:bookworm-slim with debootstrap (once per machine)"
  root=$(mktemp -d)
  debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >"$state/debootstrap.log" 2>&1 ||
    fail "debootstrap failed (see $state/debootstrap.log)"
  slim_base "$root"
  tar -C "$root" -c . | podman import - debian:bookworm-slim >/dev/null || fail "podman import of the base image failed"
  rm -rf "${root:?}"
fi

# --- build -----------------------------------------------------------------------------------
# The host's bundle (with the proxy's CA) where Debian's ca-certificates adds local CAs to the
# system store of the build; pip and uv are pointed at that store by two mounted config files.
ca=/etc/ssl/certs/ca-certificates.crt
mounts=()
if [ -f "$ca" ]; then
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$state/pip.conf"
  printf 'system-certs = true\n' >"$state/uv.toml"
  mounts=(-v "$ca:/usr/local/share/ca-certificates/build-host.crt:ro" -v "$PWD/$state/pip.conf:/etc/pip.conf:ro"
          -v "$PWD/$state/uv.toml:/etc/uv/uv.toml:ro")
fi
say "building $image"
started=$SECONDS
podman build --network host --pull=never --format docker "${mounts[@]}" -t "$image" . >"$state/build.log" 2>&1 ||
  { tail -n 30 "$state/build.log" >&2; fail "the image does not build (see $state/build.log)"; }
size=$(podman image inspect "$image" --format '{{.Size}}')
say "built in $((SECONDS - started)) s; image size $((size / 1000000)) MB"

# --- what the container uses, and removing it ------------------------------------------------
cleanup() {
  podman rm -f "$name" >/dev/null 2>&1 || true
  podman rmi "$image" >/dev/null 2>&1 || true
  dropdb -h 127.0.0.1 -U postgres --if-exists "$database" >/dev/null 2>&1 || true
  rabbitmqctl -q delete_vhost "$vhost" >/dev/null 2>&1 || true
  redis-cli -h 127.0.0.1 -n "$redis_db" flushdb >/dev/null 2>&1 || true
}
trap cleanup EXIT
createdb -h 127.0.0.1 -U postgres "$database" || fail "cannot create the database $database"
rabbitmqctl -q add_vhost "$vhost" >/dev/null && rabbitmqctl -q set_permissions -p "$vhost" guest '.*' '.*' '.*' >/dev/null ||
  fail "cannot create the RabbitMQ vhost $vhost"
redis-cli -h 127.0.0.1 -n "$redis_db" flushdb >/dev/null || fail "Redis does not answer"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
token=$(python3 -c 'import secrets; print("fake-check-token-" + secrets.token_hex(8))')
secret=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
env_args=(
  -e "EVOLUTION_INGEST_DATABASE_URL=postgresql://postgres@127.0.0.1:5432/$database"
  -e "EVOLUTION_INGEST_REDIS_URL=redis://127.0.0.1:6379/$redis_db"
  -e "EVOLUTION_INGEST_RABBITMQ_URL=amqp://guest:guest@127.0.0.1:5672/$vhost"
  -e "EVOLUTION_INGEST_HOST=127.0.0.1"
  -e "EVOLUTION_INGEST_PORT=$port"
  -e "EVOLUTION_INGEST_WEBHOOK_AUTH=url_token"
  -e "EVOLUTION_INGEST_WEBHOOK_TOKEN=$token"
  -e "EVOLUTION_INGEST_INTERNAL_SECRET=$secret"
  -e "EVOLUTION_INGEST_SHUTDOWN_TIMEOUT_SECONDS=10"
)

# --- run it: ready, one event on both channels, once; then SIGTERM ------------------------------
say "starting the container (up, host network, port $port)"
# (Without systemd podman cannot time the HEALTHCHECK itself and says so: run by hand below.)
podman run -d --name "$name" --network host "${env_args[@]}" "$image" >/dev/null 2>"$state/run.log" ||
  { cat "$state/run.log" >&2; fail "the container does not start"; }
.venv/bin/python scripts/container_probe.py --port "$port" --token "$token" \
  --database-url "postgresql://postgres@127.0.0.1:5432/$database" \
  --rabbitmq-url "amqp://guest:guest@127.0.0.1:5672/$vhost" >"$state/probe.out" ||
  { podman logs --tail 40 "$name" >&2; fail "the probe failed: $(cat "$state/probe.out")"; }
key=$(cat "$state/probe.out")
podman healthcheck run "$name" >/dev/null 2>>"$state/run.log" || fail "the HEALTHCHECK does not pass on a ready container"
# The built-in handler logs one "event" line per run of the business logic.
runs=$(podman logs "$name" 2>&1 | grep "\"dedup_key\":\"$key\"" | grep -c '"event":"event"' || true)
[ "$runs" = "1" ] || fail "the business logic ran $runs times for the event (expected once)"
say "ready, healthy; the event sent on both channels ran once ($key)"
started=$SECONDS
podman stop --time 30 "$name" >/dev/null 2>>"$state/run.log"
stopped_in=$((SECONDS - started))
code=$(podman inspect "$name" --format '{{.State.ExitCode}}')
logs=$(podman logs "$name" 2>&1)
[ "$code" = "0" ] || { echo "$logs" | tail -n 20 >&2; fail "exit status $code after SIGTERM"; }
echo "$logs" | grep -q '"signal":"SIGTERM"' || fail "the process did not see SIGTERM"
! echo "$logs" | grep -q 'Traceback' || fail "a traceback in the logs"
[ "$stopped_in" -le 15 ] || fail "SIGTERM took ${stopped_in} s to stop it (SHUTDOWN_TIMEOUT_SECONDS is 10)"
say "SIGTERM stopped it cleanly in ${stopped_in} s (exit 0)"
say "ok"
