#!/bin/bash
set -euo pipefail
cat > /app/low_stock.sh <<'SH'
#!/bin/bash
# Items to reorder: qty at or below reorder_at, not discontinued; by qty, then SKU.
set -euo pipefail
jq -r '.items
  | map(select(.qty <= .reorder_at and (.discontinued // false | not)))
  | sort_by(.qty, .sku)
  | .[]
  | [.sku, .name, (.qty | tostring)] | join("\t")' "$1"
SH
chmod +x /app/low_stock.sh
