"""The prefill worker: runs prompts, samples the first token, ships the KV to a decode worker."""
