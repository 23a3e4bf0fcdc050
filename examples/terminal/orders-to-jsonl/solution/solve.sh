#!/bin/bash
set -euo pipefail
mkdir -p /app/out
python3 - <<'PY'
import csv
import json

with open("/app/data/orders.csv", newline="", encoding="utf-8") as src, open("/app/out/orders.jsonl", "w", encoding="utf-8") as out:
    for row in csv.DictReader(src):
        if row["status"] == "cancelled":
            continue
        order = {"id": int(row["id"]), "customer": row["customer"], "amount": float(row["amount"]),
                 "items": [i for i in row["items"].split(";") if i], "shipped": row["status"] == "shipped"}
        out.write(json.dumps(order, ensure_ascii=False) + "\n")
PY
