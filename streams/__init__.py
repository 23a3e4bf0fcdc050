"""Stream processors: calls -> trajectories -> training groups, with Faust (see docs/streams.md)."""
