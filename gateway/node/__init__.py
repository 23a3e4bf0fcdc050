"""Gateway nodes: host the gateway and run sessions from polar.sessions through INIT → READY → RUN → POSTRUN."""
