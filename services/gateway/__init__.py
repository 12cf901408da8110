"""The OpenAI-compatible HTTP gateway: request parsing, detokenization, streaming."""
