"""Serving a transformers model on the engine: the model it loads (model.py), the OpenAI-compatible server
(server.py) and its request fields, sampling and errors (openai_api.py)."""
