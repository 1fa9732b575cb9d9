"""Calculators (``run.py memory``): closed-form figures checked against the seeds' stated values."""
