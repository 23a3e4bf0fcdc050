#!/bin/bash
set -euo pipefail
tail -n +2 /app/meetings.csv | sort -t, -k1,1n | awk -F, '
  NR == 1 { s = $1; e = $2; next }
  $1 <= e { if ($2 > e) e = $2; next }
  { print s "-" e; s = $1; e = $2 }
  END { print s "-" e }' > /app/busy.txt
