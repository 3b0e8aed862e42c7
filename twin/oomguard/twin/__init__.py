"""GPU twin: a model-free vLLM executor with GPU memory and step-time physics, and traces."""
