"""The gateway: a transparent model-API proxy that records every call token-faithfully into Kafka."""
