"""The OpenAI-compatible server: api_server.py (the app, the process), serving.py
(completions and chat answers, SSE), protocol.py (request validation, error objects),
metrics.py (/metrics), settings.py (ServerSettings and its defaults). All but settings.py
import fastapi, uvicorn and prometheus-client (the serve extra); nothing else in nanokv
imports them except `nanokv serve`, lazily (the CLI's flags read settings.py)."""
