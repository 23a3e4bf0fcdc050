#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import configparser, re
cp = configparser.ConfigParser(interpolation=None)
cp.read("/app/service.ini")
lines = sorted(f"{re.sub(r'[-.]', '_', f'{s}_{k}').upper()}={v}" for s in cp.sections() for k, v in cp[s].items())
open("/app/service.env", "w").write("\n".join(lines) + "\n")
PY
