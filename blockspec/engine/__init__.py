"""Running models for requests: sequences, the KV slots, the model runner (every forward pass), sampling,
and continuous batching (the scheduler)."""
