"""Where programs run: the runtime over HTTP or ZeroMQ, or any OpenAI-compatible server."""
