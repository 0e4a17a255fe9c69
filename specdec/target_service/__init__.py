"""The target model's gRPC service: verifies drafts in one forward pass."""
