"""The OpenAI-compatible HTTP server (FastAPI): routes, SSE streaming, metrics. See issue "OpenAI-compatible HTTP server"."""
