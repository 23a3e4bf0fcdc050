#!/bin/bash
# Runs the agent's script on inventories it has not seen; reward 1 when every output matches.
cd /app
fail=0
check() {  # check NAME INVENTORY EXPECTED
  got=$(timeout 20 bash /app/low_stock.sh "$2" 2>&1)
  rc=$?
  if [ "$rc" -eq 0 ] && [ "$got" = "$3" ]; then
    echo "ok   $1"
  else
    echo "FAIL $1 (exit $rc)"; echo "--- expected"; echo "$3"; echo "--- got"; echo "$got"
    fail=1
  fi
}
[ -f /app/low_stock.sh ] || { echo "/app/low_stock.sh does not exist"; echo 0 > /logs/verifier/reward.txt; exit 0; }
check sample /app/inventory.json "$(printf 'B-200\twasher 6mm\t0\nC-310\tcable tie\t50\nA-101\thex nut M6\t80')"
check ties /tests/ties.json "$(printf 'K-1\tkey A\t3\nK-2\tkey B\t3\nK-9\tkey C\t3')"
check none /tests/none.json ""
echo $((1 - fail)) > /logs/verifier/reward.txt
