#!/bin/bash
# The reference solution (Harbor's oracle): run in the task's working dir.
set -e
cat > /app/words.py <<'EOF'
def count_words(text: str) -> int:
    """Number of whitespace-separated words."""
    return len(text.split())
EOF
