"""The local engine: prompts, label checks, scheduling and calibration over a backend (``backends/``)."""
