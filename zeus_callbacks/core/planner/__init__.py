"""Offline solvers: the Perseus time-energy frontier and the heterogeneous-GPU allocation."""
