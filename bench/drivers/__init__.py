"""One driver per system; each runs in that system's own environment (``python -m bench.drivers.X``)."""
