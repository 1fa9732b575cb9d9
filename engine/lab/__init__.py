"""The cost lab: measurements, the memory calculator and plots (run.py bench / memory / explain / show)."""
