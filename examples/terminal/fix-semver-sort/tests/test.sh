#!/bin/bash
# The image has pytest (Debian's python3-pytest); the reward is 1 when every test passes, else 0.
cd /app
PYTHONPATH=/app python3 -m pytest -q -p no:cacheprovider /tests/test_semver.py > /logs/verifier/pytest.log 2>&1
rc=$?
cat /logs/verifier/pytest.log
if [ "$rc" -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
