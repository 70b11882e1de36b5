"""The OpenAI-compatible server: api_server.py (the app, the process), serving.py
(completions and chat answers, SSE), protocol.py (request validation, error objects),
metrics.py (/metrics). Imports fastapi, uvicorn and prometheus-client (the serve extra);
nothing else in nanokv imports this package except `nanokv serve`, lazily."""
