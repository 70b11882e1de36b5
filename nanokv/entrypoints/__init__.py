"""Entry points: the command line (cli/) and the OpenAI-compatible server."""
