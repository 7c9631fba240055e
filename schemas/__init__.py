"""Mini-Infer wire contract v1 (see DESIGN.md). Imports nothing of ours and nothing of Kafka."""
