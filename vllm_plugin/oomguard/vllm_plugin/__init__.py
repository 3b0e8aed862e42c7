"""Code that runs inside vLLM: engine-side admission cap and drain, HTTP routes, allocator stats."""
