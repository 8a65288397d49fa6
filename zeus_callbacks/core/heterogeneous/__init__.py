"""The heterogeneous planner (Zeus²): planning, its profile file, and uneven training."""
