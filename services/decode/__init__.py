"""The decode worker: receives KV, runs continuous batching, streams tokens to gateways."""
