"""Measuring runs and checking them against the prediction: step timing, calibration, the
profiles it writes, fitted exchange costs and the predicted-vs-measured points of
``run --check``."""
