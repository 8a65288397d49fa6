"""The optimizer's choice is news, not a warning (issue 37: the demo printed it after `WARNING`): the library
logs it at INFO, and `zeus-callbacks demo` shows the power-limit optimizer's INFO lines without a level."""

from __future__ import annotations

import io
import logging

from helpers import profile_to_the_end

from zeus_callbacks import sim
from zeus_callbacks.cli.demo_env import package_log
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.selectors import Time


def test_the_choice_is_logged_at_info(caplog):
    """Fails if the choice is logged at WARNING (as it was)."""
    system = sim.simulate("a40", virtual_clock=True)
    opt = GlobalPowerLimitOptimizer(ZeusMonitor([0]), Time(), warmup_steps=1, profile_steps=2, pl_step=100)
    with caplog.at_level(logging.INFO, logger="zeus_callbacks"):
        profile_to_the_end(opt, system)
    chose = [r for r in caplog.records if "chose the power limit" in r.getMessage()]
    assert len(chose) == 1 and chose[0].levelno == logging.INFO, [
        (r.levelname, r.getMessage()) for r in chose
    ]


def test_the_demo_shows_the_optimizers_info_lines_without_a_level():
    """The optimizer's INFO lines as they are, warnings with their level, the monitor's INFO lines left out;
    and the package's logging as it was afterwards."""
    logger = logging.getLogger("zeus_callbacks")
    before = (logger.level, logger.propagate, list(logger.handlers))
    out = io.StringIO()
    with package_log(out):
        logging.getLogger("zeus_callbacks.core.power_limit.optimizer").info("chose %d W", 175)
        logging.getLogger("zeus_callbacks.core.power_limit.job").warning("capped")
        logging.getLogger("zeus_callbacks.core.monitor.monitor").info("CPU energy is not measured")
    assert out.getvalue().splitlines() == [
        "chose 175 W",
        "WARNING zeus_callbacks.core.power_limit.job: capped",
    ]
    assert (logger.level, logger.propagate, list(logger.handlers)) == before
