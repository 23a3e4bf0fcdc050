#!/bin/bash
# Four checks against a log the agent has not seen; the reward is the fraction that pass, written to
# /logs/verifier/reward.json with each check's outcome.
cd /app
log=/tests/hidden.log
expected=("requests 9" "unique_ips 4" "top_path /api/items" "server_errors 3")
if [ -x /app/report.sh ]; then
  mapfile -t got < <(timeout 20 /app/report.sh "$log" 2>/logs/verifier/stderr.txt)
else
  echo "/app/report.sh is missing or not executable"
  got=()
fi
passed=0
checks=""
for i in 0 1 2 3; do
  name=${expected[$i]%% *}
  if [ "${got[$i]:-}" = "${expected[$i]}" ]; then ok=1; passed=$((passed + 1)); else ok=0; fi
  echo "$name: expected '${expected[$i]}', got '${got[$i]:-}'"
  checks="$checks\"$name\": $ok, "
done
reward=$(awk -v p="$passed" 'BEGIN { printf "%.2f", p / 4 }')
echo "{${checks}\"reward\": $reward}" > /logs/verifier/reward.json
cat /logs/verifier/reward.json
