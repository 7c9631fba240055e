"""Mini-Infer worker service: Kafka in, engine in the middle, streamed replies out."""
