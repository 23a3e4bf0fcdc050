#!/bin/bash
# The reference solution (Harbor's oracle): run in the task's working dir.
set -e
cat > /app/textutil.py <<'EOF'
import re


def slugify(text: str) -> str:
    """URL slug of text."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
EOF
