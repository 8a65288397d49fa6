"""A run's report: a recorder the sessions call (`run_record`), its on-disk schema (`records`), and a
renderer of one self-contained HTML file (`html`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zeus_callbacks.core.report.run_record import RunRecorder, load_run

__all__ = ["RunRecorder", "load_run", "ReportRecorder", "start_report", "run_dir_for"]


def run_dir_for(report_path: str | Path) -> Path:
    """The RUN_DIR kept beside a report: `report.html` -> `report.run/`."""
    path = Path(report_path)
    return path.with_name(f"{path.stem}.run")


class ReportRecorder(RunRecorder):
    """A `RunRecorder` whose `finish` also writes the HTML report (on rank 0), for a `report_path=` option."""

    def __init__(self, report_path: str | Path, monitor: Any, **kwargs: Any) -> None:
        self.report_path = Path(report_path)
        super().__init__(run_dir_for(report_path), monitor, **kwargs)

    def finish(self, optimizers: Any = (), failed: str | None = None) -> Path:
        """Write the record, then (rank 0) the report from every rank's record found; returns the report's
        path. A report that cannot be written is logged, never raised: training has ended well."""
        import logging

        from zeus_callbacks.core import distributed as dist
        from zeus_callbacks.core.report.html import write_report

        done = self._finished
        super().finish(optimizers, failed)
        if not done and self.record.rank == 0:
            if dist.is_distributed():
                dist.all_gather_object(None)  # every rank's record is written first
            try:
                write_report(self.path.parent, self.report_path)
            except (OSError, ValueError) as e:
                logging.getLogger(__name__).warning("Cannot write the report %s: %s", self.report_path, e)
        elif not done and dist.is_distributed():
            dist.all_gather_object(None)
        return self.report_path


def start_report(report_path: str | Path, monitor: Any, **kwargs: Any) -> ReportRecorder:
    """Record into `<report_path stem>.run/`; `finish()` writes the HTML report at `report_path`."""
    return ReportRecorder(report_path, monitor, **kwargs)
