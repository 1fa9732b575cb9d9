"""Serving a transformers model on the engine: its loader (model.py) and the OpenAI-compatible server (server.py)."""
