#!/bin/bash
set -euo pipefail
cat > /app/report.sh <<'SH'
#!/bin/bash
# Four-line summary of a combined-format access log.
log=${1:-/app/logs/access.log}
awk '
  { n++; ips[$1] = 1; hits[$7]++; if ($9 + 0 >= 500) errors++ }
  END {
    for (ip in ips) unique++
    for (p in hits) if (hits[p] > best || (hits[p] == best && p < top)) { best = hits[p]; top = p }
    printf "requests %d\nunique_ips %d\ntop_path %s\nserver_errors %d\n", n, unique, top, errors
  }' "$log"
SH
chmod +x /app/report.sh
