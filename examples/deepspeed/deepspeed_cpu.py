"""Start DeepSpeed on a CPU-only host without compiling its shared-memory op: for tests and simulations only.

On CPU, `deepspeed.init_distributed()` (also called by `deepspeed.initialize`) builds the `ShareMemCommBuilder`
op with g++ the first time (4-5 minutes, while the other ranks wait), to speed up intra-node all-reduce. No
environment variable skips it (`DS_BUILD_OPS=0` only stops pre-building at install; deepspeed/comm/torch.py
`build_shm_op` then JIT-builds it): the op is built only if `deepspeed.ops.__compatible_ops__` says it is
compatible, and that dict is cached on first access so that edits persist (deepspeed/ops/__init__.py).
`skip_shared_memory_op()` marks it incompatible, and DeepSpeed's collectives use plain gloo. Not needed on GPUs.
"""

from __future__ import annotations

__all__ = ["skip_shared_memory_op"]

_SHM_OP = "deepspeed_shm_comm"  # ShareMemCommBuilder.NAME (deepspeed/ops/op_builder/cpu/comm.py)


def skip_shared_memory_op() -> None:
    """Let `deepspeed.init_distributed()` use gloo without JIT-compiling the shared-memory op (call it first)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[_SHM_OP] = False
