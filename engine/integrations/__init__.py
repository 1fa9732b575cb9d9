"""Integrations with other libraries (optional extras)."""
