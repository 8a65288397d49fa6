"""Refuses the unofficial `pynvml` before any simulator module reads it: the simulator answers beneath NVIDIA's
nvidia-ml-py, and the unofficial package would fail later with an unrelated error."""

from zeus_callbacks.core.device.nvidia import official_pynvml

official_pynvml()
