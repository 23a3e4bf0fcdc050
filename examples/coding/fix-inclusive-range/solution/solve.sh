#!/bin/bash
# The reference solution (Harbor's oracle): run in the task's working dir.
set -e
cat > /app/ranges.py <<'EOF'
def inclusive_range(a: int, b: int) -> list[int]:
    """Every integer from a to b, both included."""
    return list(range(a, b + 1))
EOF
