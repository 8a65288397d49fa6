"""The global power-limit optimizer: the optimizer, its search, selectors and profile file."""
