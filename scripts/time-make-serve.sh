#!/usr/bin/env bash
# Seconds from `make serve` to the first 200 on /health, then Ctrl-C (a clean shutdown).
# Usage: scripts/time-make-serve.sh [PORT]   (make serve must be able to bind PORT, default 8000)
set -u
cd "$(dirname "$0")/.."
port=${1:-8000}
log=$(mktemp)
start=$(date +%s.%N)
make serve ARGS="--port $port" > "$log" 2>&1 &
pid=$!
until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
  if ! kill -0 "$pid" 2> /dev/null; then echo "make serve exited; its log: $log"; exit 1; fi
  sleep 0.2
done
end=$(date +%s.%N)
echo "ready after $(python3 -c "print(round($end - $start, 1))") s (log: $log)"
pkill -INT -f "tierserve serve --port $port"
wait "$pid"
