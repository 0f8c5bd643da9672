"""The OpenAI-compatible HTTP server: ``http`` (the HTTP layer and its limits), ``app`` (routes),
``protocol`` (request and response bodies), ``async_engine`` (the engine thread), ``metrics``."""
