"""The engine: a Llama-family model on a paged KV cache, its block manager, sampler, step loop."""
