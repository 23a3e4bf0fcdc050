"""Offline tools over the recorded topics: replay into a new namespace, evaluation, dataset export."""
