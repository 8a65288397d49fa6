"""The energy monitor: measurement windows, energy reporting and per-epoch logs."""
