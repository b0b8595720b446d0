"""A near miss of a strategy name gets "did you mean ...?"; a name further off keeps Lightning's own error."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_roundpipe  # noqa: F401 - registers the names


@pytest.mark.parametrize("given, meant", [
    ("roundpip", "roundpipe"), ("round_pipe", "roundpipe"), ("Round-Pipe", "roundpipe"), ("ruondpipe", "roundpipe"),
    ("roundpipe-async", "roundpipe_async"), ("roundpipeasync", "roundpipe_async"), ("RoundPipe_Asyn", "roundpipe_async"),
])
def test_a_near_miss_names_the_strategy_it_meant(given, meant):
    with pytest.raises(ValueError) as error:
        pl.Trainer(strategy=given, accelerator="cpu", devices=1, logger=False)
    given = given.lower()  # Lightning lower-cases the name before it looks it up
    assert str(error.value) == (f"You selected an invalid strategy name: `strategy={given!r}`: did you mean "
                                f"{meant!r}? RoundPipe's strategies are 'roundpipe', 'roundpipe_async'")


def test_a_name_further_off_keeps_lightnings_error():
    with pytest.raises(ValueError, match=r"^You selected an invalid strategy name: `strategy='pipeline'`\. It must"):
        pl.Trainer(strategy="pipeline", accelerator="cpu", devices=1, logger=False)


def test_the_real_names_and_lightnings_own_are_untouched():
    for name in ("roundpipe", "roundpipe_async", "ddp", "deepspeed", "fsdp", "single_device"):
        description = StrategyRegistry[name]["description"]
        assert "misspelling" not in description, (name, description)
