"""Infrastructure: settings, the Kafka broker, the S3 server, topics, object storage, model names (models/)."""
