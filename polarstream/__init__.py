"""polarstream: RL of coding agents through the model-API boundary, with Kafka as the system of record."""

__version__ = "0.1.0"
