"""The draft model's gRPC service: proposes γ tokens per round, streamed."""
