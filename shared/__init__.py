"""tandem's common library: the engine (model, KV cache, sampling), wire schema and configuration."""
