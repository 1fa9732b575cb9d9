"""Benchmarks (``run.py bench ...``): each times implementations side by side and saves tables and plots."""
