import csv
import hashlib
import json
import sys

CSV_SHA256 = "c697de233d7be95bf3f35b3f16f47783b3e580439ead2ddcb65cbb6278739678"

src, out = sys.argv[1], sys.argv[2]
with open(src, "rb") as f:
    if hashlib.sha256(f.read()).hexdigest() != CSV_SHA256:
        sys.exit(f"{src} was changed")
with open(src, newline="", encoding="utf-8") as f:
    expected = [{"id": int(r["id"]), "customer": r["customer"], "amount": float(r["amount"]),
                 "items": [i for i in r["items"].split(";") if i], "shipped": r["status"] == "shipped"}
                for r in csv.DictReader(f) if r["status"] != "cancelled"]
try:
    with open(out, encoding="utf-8") as f:
        got = [json.loads(line) for line in f if line.strip()]
except FileNotFoundError:
    sys.exit(f"{out} does not exist")
except json.JSONDecodeError as e:
    sys.exit(f"{out}: a line is not JSON ({e})")
if len(got) != len(expected):
    sys.exit(f"{len(got)} orders, expected {len(expected)}")
for g, e in zip(got, expected):
    if set(g) != set(e):
        sys.exit(f"order {e['id']}: keys {sorted(g)}, expected {sorted(e)}")
    for key in e:
        same = isinstance(g[key], (int, float)) and not isinstance(g[key], bool) and abs(g[key] - e[key]) < 1e-9 \
            if key == "amount" else (g[key] == e[key] and type(g[key]) is type(e[key]))
        if not same:
            sys.exit(f"order {e['id']}: {key} is {g[key]!r}, expected {e[key]!r}")
print(f"{len(got)} orders match")
