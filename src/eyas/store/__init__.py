"""The feature store: target hidden states in safetensors shards, written atomically and resumably."""
