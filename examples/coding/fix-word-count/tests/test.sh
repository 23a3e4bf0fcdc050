#!/bin/bash
# Terminal-Bench-shaped verifier: run the hidden tests from the task's working dir and write the reward
# Harbor reads (/logs/verifier/reward.txt: 1 when every test passes, else 0); it exits 0 either way.
cd /app
if PYTHONPATH=/app python3 -m unittest discover -s /tests -p 'test_*.py' -v > /logs/verifier/unittest.log 2>&1; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
cat /logs/verifier/unittest.log
