#!/bin/bash
# The reference solution (Harbor's oracle): run in the task's working dir.
set -e
cat > /app/intervals.py <<'EOF'
def merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping or touching intervals merged, sorted by start."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
EOF
