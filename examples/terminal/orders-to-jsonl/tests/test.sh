#!/bin/bash
# The agent's output must be where the task asked for it, in the container as the agent left it: the
# checker reads /app/out/orders.jsonl in place and compares it with its own reading of the CSV.
cd /app
if python3 /tests/check_output.py /app/data/orders.csv /app/out/orders.jsonl; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
