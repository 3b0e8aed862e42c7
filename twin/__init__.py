"""GPU twin: a model-free vLLM executor now; the GPU memory and step-time model later."""
