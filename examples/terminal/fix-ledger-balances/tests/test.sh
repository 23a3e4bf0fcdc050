#!/bin/bash
# Hidden unit tests, run from the task's working directory (/srv/ledger); reward 1 when all pass.
cd /srv/ledger
if python3 -m unittest discover -s /tests -p 'test_*.py' -t /tests -v > /logs/verifier/unittest.log 2>&1; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
cat /logs/verifier/unittest.log
