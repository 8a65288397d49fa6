"""Which dump file a simulation spec names: `PREFIX:FILE[:WORKLOAD]`, FILE a path or a shipped dump's name."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.sim.node_spec import SPEC_INPUT

__all__ = ["DumpFiles", "dump_dir"]


def dump_dir() -> Path:
    """The folder of the dumps shipped with the package."""
    return Path(str(resources.files("zeus_callbacks"))) / "sim" / "data" / "gpu_dumps"


@dataclass(frozen=True)
class DumpFiles:
    """One tool's dumps: `nvidia-smi:` specs name `*.nvidia-smi-a.txt` files, `rocm-smi:` ones `*.rocm-smi-a.txt`.

    Args:
        prefix: the spec's prefix, e.g. `nvidia-smi:`.
        suffix: the ending of the shipped dumps' file names, e.g. `.nvidia-smi-a.txt`.
        kind: what a dump is called in errors, e.g. `rocm-smi dump`.
        command: the command whose saved output a dump is, e.g. `nvidia-smi -q`.
        example: a shipped dump's name for the errors' example, e.g. `A10`.
    """

    prefix: str
    suffix: str
    kind: str
    command: str
    example: str

    def is_spec(self, spec: str) -> bool:
        """Whether a simulation spec names one of these dumps (`PREFIX:FILE[:WORKLOAD]`)."""
        return spec.strip().startswith(self.prefix)

    def shipped(self) -> list[str]:
        """The names of the shipped dumps of this tool, e.g. `A10`, `V100_x8`."""
        return sorted(p.name.removesuffix(self.suffix) for p in dump_dir().glob(f"*{self.suffix}"))

    def _resolve(self, target: str) -> Path | None:
        """The file a spec's target names: a path, else a shipped dump's name (case-insensitive)."""
        path = Path(target).expanduser()
        if path.is_file():
            return path
        by_name = {name.lower(): name for name in self.shipped()}
        name = by_name.get(target.lower().removesuffix(self.suffix.lower()))
        return None if name is None else dump_dir() / f"{name}{self.suffix}"

    def target(self, spec: str) -> tuple[Path, str | None]:
        """(dump file, workload key) of `PREFIX:FILE[:WORKLOAD]`.

        Raises:
            InvalidInputError: FILE is neither a file nor a shipped dump's name.
        """
        rest = spec.strip()[len(self.prefix) :].strip()
        path = self._resolve(rest) if rest else None
        if path is not None:
            return path, None
        head, colon, workload = rest.rpartition(":")
        path = self._resolve(head) if colon and head else None
        if path is not None:
            return path, workload.strip() or None
        raise InvalidInputError(
            f"{SPEC_INPUT} {spec!r}: {rest!r} is neither a file nor a shipped {self.kind}. Give the path of a saved "
            f"`{self.command}` output, or one of: {', '.join(self.shipped())} (e.g. "
            f"ZEUS_CALLBACKS_SIMULATE={self.prefix}{self.example})."
        )

    def canonical(self, spec: str) -> str:
        """`PREFIX:FILE[:WORKLOAD]` with FILE an absolute path, or a shipped dump's own name, so that a process
        started in another directory simulates the same node."""
        path, workload = self.target(spec)
        shipped = (
            path.parent == dump_dir() and not Path(spec.strip()[len(self.prefix) :]).expanduser().is_file()
        )
        name = path.name.removesuffix(self.suffix) if shipped else str(path.resolve())
        return self.prefix + name + (f":{workload}" if workload else "")
