#!/usr/bin/env bash
# One device call for the whole project: versions, every GPU test, and the main job
# (`tilefuse bench all --quick`). Logs and JSON go to $OUT (default /tmp/tilefuse-out).
#   bash scripts/gpu_all.sh [pytest seconds] [bench seconds]
set -o pipefail
OUT=${OUT:-/tmp/tilefuse-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  python3 -m tilefuse info
  timeout "${1:-100}" python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=line tests > "$OUT/pytest.txt" 2>&1
  echo "pytest exit $?"
  grep -E "^(/|E |FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | grep -v Warning | cut -c1-200 | tail -40
  timeout "${2:-170}" python3 -m tilefuse bench all --quick --rep-ms 15 --out "$OUT"
  echo "bench exit $?"
} 2>&1 | tee "$OUT/log.txt"
