"""Runtime around the models: loading, placement, KV cache, runner, generation."""
