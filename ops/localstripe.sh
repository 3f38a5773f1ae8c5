# Sourced by ops/test.sh: localstripe (a stateful fake Stripe nobody here
# wrote, from PyPI) for tests/localstripe.rs, the Stripe connector's
# interoperability test.
#   source ops/localstripe.sh   # then: localstripe_up; ...; localstripe_down
# localstripe_up installs the pinned version into a virtualenv under the
# build directory (once), starts it on a free port and exports
# COBRO_TEST_LOCALSTRIPE_URL (loopback). localstripe listens on every
# interface (it binds `::`, no option to narrow it); it holds test data only.

LOCALSTRIPE_VERSION=1.15.10

localstripe_up() {
  local root target venv port
  root="$(pwd)"
  target="${CARGO_TARGET_DIR:-$root/target}"
  venv="$target/localstripe-venv"
  if ! "$venv/bin/pip" show localstripe 2>/dev/null | grep -q "^Version: $LOCALSTRIPE_VERSION$"; then
    echo "localstripe.sh: installing localstripe $LOCALSTRIPE_VERSION into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "localstripe==$LOCALSTRIPE_VERSION"
  fi
  # A port free now (the kernel's pick); localstripe takes no port 0.
  port="$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  # --from-scratch: never load another run's /tmp/localstripe.pickle.
  "$venv/bin/localstripe" --port "$port" --from-scratch >"$target/localstripe.log" 2>&1 &
  LOCALSTRIPE_PID=$!
  local url="http://127.0.0.1:$port"
  for _ in $(seq 1 100); do
    if "$venv/bin/python" -c "import socket; socket.create_connection(('127.0.0.1', $port), 0.2)" 2>/dev/null; then
      export COBRO_TEST_LOCALSTRIPE_URL="$url"
      echo "localstripe.sh: localstripe $LOCALSTRIPE_VERSION on $url (log: $target/localstripe.log)" >&2
      return 0
    fi
    if ! kill -0 "$LOCALSTRIPE_PID" 2>/dev/null; then
      break
    fi
    sleep 0.1
  done
  echo "localstripe.sh: localstripe did not start; its log:" >&2
  cat "$target/localstripe.log" >&2
  return 1
}

localstripe_down() {
  if [ -n "${LOCALSTRIPE_PID:-}" ]; then
    kill "$LOCALSTRIPE_PID" 2>/dev/null || true
    wait "$LOCALSTRIPE_PID" 2>/dev/null || true
    LOCALSTRIPE_PID=
  fi
}
