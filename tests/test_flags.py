"""Strict flag parsing, and what a bad value does to the outcome and to the launch."""

from __future__ import annotations

import subprocess

import pytest

from adapter import folded_fence, runtime
from adapter.flags import FlagError, parse_switch
from tests.engines import ROOT, engine_env, python

GOOD = {"1": True, "0": False, "on": True, "off": False, "true": True, "false": False, "none": False,
        "ON": True, "Off": False, "TRUE": True, "False": False, "tRuE": True, "NONE": False}
BAD = ["", " ", "yes", "no", "yes please", "2", "-1", "01", "10", "tru", "enabled", "1 ", " on",
       "0x1", "nothing", "true\n", "y", "disable"]


@pytest.mark.parametrize("value,expected", sorted(GOOD.items()))
def test_good_values_parse(value, expected):
    assert parse_switch("DSV41_FOLDED_FENCE", {"DSV41_FOLDED_FENCE": value}) is expected


def test_unset_means_off():
    assert parse_switch("DSV41_FOLDED_FENCE", {}) is False


@pytest.mark.parametrize("value", BAD)
def test_bad_values_are_startup_errors(value):
    with pytest.raises(FlagError) as error:
        parse_switch("DSV41_FOLDED_FENCE", {"DSV41_FOLDED_FENCE": value})
    message = str(error.value)
    assert message.startswith(f"DSV41_FOLDED_FENCE={value!r} is not understood")
    assert "1/on/true" in message and "0/off/false/none" in message


def decide_fence(value):
    return runtime.decide({"DSV41_FOLDED_FENCE": value}, names=(folded_fence.NAME,)).outcomes[0]


def test_bad_value_makes_the_adapter_refused_without_touching_the_engine():
    outcome = decide_fence("yes please")
    assert outcome.state == runtime.REFUSED
    assert "DSV41_FOLDED_FENCE='yes please' is not understood" in outcome.reason
    assert "REFUSED" in outcome.line() and "folded_fence" in outcome.line()


def test_off_adapter_patches_nothing():
    outcome = decide_fence("off")
    assert (outcome.state, outcome.reason) == (runtime.OFF, "DSV41_FOLDED_FENCE is off")


def test_launch_with_a_bad_flag_stops_before_the_engine_starts():
    env = engine_env("0.5.23", DSV41_FOLDED_FENCE="enabled")
    done = subprocess.run([python(), "entrypoint.py", "--model-path", "/nonexistent", "--tp", "4"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 78  # a pack flag not understood (the engine's own argument errors are 2)
    assert "the engine must not start: DSV41_FOLDED_FENCE='enabled' is not understood" in done.stderr
    # The engine's server module never ran: its argument parsing would have complained first.
    assert "launch_server" not in done.stderr


def test_a_misspelt_flag_stops_the_launch_and_fails_strict_doctor():
    env = engine_env("0.5.23", DSV41_FOLDED_FENSE="1")
    done = subprocess.run([python(), "entrypoint.py", "--model-path", "/nonexistent"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 78
    assert ("DSV41_FOLDED_FENSE is not a flag of this pack; did you mean DSV41_FOLDED_FENCE? (its flags: DSV41_ADAPTERS, "
            "DSV41_ADAPTERS_LOG, DSV41_FOLDED_FENCE, ") in done.stderr
    assert runtime.unknown_flags({"DSV41_FOLDED_FENCE": "1", "DSV41_SPEC_TP_SYNC": "all", "PATH": "/bin"}) == []
