"""``pi-server``: an OpenAI-compatible HTTP server beside the runtime (FastAPI + uvicorn)."""
