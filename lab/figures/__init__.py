"""Teaching figures (``run.py explain scaling``, ``run.py show weights``): computed, plotted, saved."""
