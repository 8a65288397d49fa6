"""The framework-free core that every adapter uses."""
