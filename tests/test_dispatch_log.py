"""round_size="auto" logs its dispatch once, when the planner's measurements have settled, not each provisional
choice on the way (which can go back and forth between whole jobs and rounds while the times are noisy)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from lightning_roundpipe import EngineOptions, RoundPipeEngine
from lightning_roundpipe.engine import dispatch as dispatch_module
from tests.models import bn_model

INFO = "lightning_roundpipe.engine.dispatch"


def test_the_dispatch_is_logged_once_when_it_settles(caplog, monkeypatch):
    # (settled, microbatches) per call, the choice the simulator returns, and what INFO says after it
    calls = [(False, 3, 2), (False, 4, None), (False, 3, 2),   # provisional: DEBUG only
             (True, 3, 2), (True, 4, 2), (True, 3, 2),       # settled: said once
             (True, 4, None)]                                  # a settled choice that changes: said again
    choices = iter(choice for _, _, choice in calls)
    monkeypatch.setattr(dispatch_module, "choose_round_size", lambda *args, **kwargs: next(choices))
    with RoundPipeEngine(bn_model(), [torch.device("cpu")] * 2, EngineOptions(round_size="auto")) as engine:
        dispatcher = engine.dispatcher
        planner = dispatcher.planner
        stub = SimpleNamespace(estimate=[], settled=False, job_cost=0.0)
        dispatcher.planner = stub  # type: ignore[assignment]
        try:
            with caplog.at_level(logging.DEBUG, logger=INFO):
                for settled, microbatches, choice in calls:
                    stub.settled = settled
                    assert dispatcher.round_size(planner.plan, microbatches) == choice
        finally:
            dispatcher.planner = planner
    said = [(record.levelname, record.getMessage()) for record in caplog.records if "dispatches" in record.getMessage()]
    assert [level for level, _ in said] == ["DEBUG"] * 3 + ["INFO"] * 2
    assert [message for level, message in said if level == "INFO"] == [
        "RoundPipe dispatches each training batch in rounds of 2 microbatches (predicted fastest from the settled "
        "measured costs)",
        "RoundPipe dispatches each training batch in whole jobs (predicted fastest from the settled measured costs)"]
    assert "for now (provisional" in said[0][1]
