"""The device layer: the only code that calls NVML (GPUs by UUID, errors, the state guard, backends)."""
