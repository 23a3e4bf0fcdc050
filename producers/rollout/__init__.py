"""The rollout server: tasks in, sessions out, progress and cancellation (see server.py)."""
