"""Strict flag parsing, and what a bad value does to the outcome and to the launch."""

from __future__ import annotations

import subprocess

import pytest

from sglang_dsv41_adapters import folded_fence
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters.framework.flags import FlagError, parse_switch
from harness.engines import ROOT, engine_env, python
from harness import zygote
from tests.log_lines import untimed

GOOD = {"1": True, "0": False, "on": True, "off": False, "true": True, "false": False, "none": False,
        "ON": True, "Off": False, "TRUE": True, "False": False, "tRuE": True, "NONE": False}
BAD = ["", " ", "yes please", "2", "-1", "01", "10", "tru", "enabled", "1 ", " on", " yes", "ye", "nope",
       "0x1", "nothing", "true\n", "disable"]
# Every word the engine's own EnvBool takes, in three cases: what it means there, it means here.
ENGINE_WORDS = ["true", "1", "yes", "y", "false", "0", "no", "n"]


@pytest.mark.parametrize("word", list(dict.fromkeys(w for word in ENGINE_WORDS for w in (word, word.upper(), word.title()))))
def test_the_engines_boolean_words_mean_the_same_here(word):
    from sglang.srt.environ import EnvBool

    assert parse_switch("DSV41_FOLDED_FENCE", {"DSV41_FOLDED_FENCE": word}) is EnvBool(False).parse(word)


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
    assert "1/on/true/yes/y" in message and "0/off/false/none/no/n" in message


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
    done = zygote.run([python(), "entrypoint.py", "--model-path", "/nonexistent", "--tp", "4"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 78  # a pack flag not understood (the engine's own argument errors are 2)
    assert "the engine must not start: DSV41_FOLDED_FENCE='enabled' is not understood" in done.stderr
    # The engine's server module never ran: its argument parsing would have complained first.
    assert "launch_server" not in done.stderr


def test_a_misspelt_flag_stops_the_launch_and_fails_strict_doctor():
    env = engine_env("0.5.23", DSV41_FOLDED_FENSE="1")
    done = zygote.run([python(), "entrypoint.py", "--model-path", "/nonexistent"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 78
    assert ("DSV41_FOLDED_FENSE is not a flag of this pack; did you mean DSV41_FOLDED_FENCE? (its flags: DSV41_ADAPTERS, "
            "DSV41_ADAPTERS_LOG, DSV41_ADAPTERS_PROOF_CACHE, DSV41_ADAPTERS_SNAPSHOT_KERNEL, DSV41_FOLDED_FENCE, ") in done.stderr
    assert runtime.unknown_flags({"DSV41_FOLDED_FENCE": "1", "DSV41_SPEC_TP_SYNC": "all", "PATH": "/bin"}) == []
    # doctor, with and without --strict: the verdict and its reason first, exit 78; --exit-zero for a report
    for args, status in ((["doctor"], 78), (["doctor", "--strict"], 78), (["doctor", "--exit-zero"], 0)):
        doctor = zygote.run([python(), "entrypoint.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=240)
        assert doctor.returncode == status, (args, doctor.stdout[-2000:], doctor.stderr[-2000:])
        verdict, reason = doctor.stdout.splitlines()[:2]
        assert verdict.startswith("verdict: flag-error (exit ") and "78" in verdict, (args, verdict)
        assert reason.startswith("  flag error: DSV41_FOLDED_FENSE is not a flag of this pack; did you mean "
                                 "DSV41_FOLDED_FENCE?"), (args, reason)


# --- Kubernetes service links -------------------------------------------------------------------
# What Kubernetes gives every container for a Service named `dsv41` (port 30000, named http) in
# its namespace, unless the pod sets enableServiceLinks: false.
SERVICE = {"DSV41_SERVICE_HOST": "10.0.0.1", "DSV41_SERVICE_PORT": "30000", "DSV41_SERVICE_PORT_HTTP": "30000",
           "DSV41_PORT": "tcp://10.0.0.1:30000", "DSV41_PORT_30000_TCP": "tcp://10.0.0.1:30000",
           "DSV41_PORT_30000_TCP_PROTO": "tcp", "DSV41_PORT_30000_TCP_PORT": "30000",
           "DSV41_PORT_30000_TCP_ADDR": "10.0.0.1"}
# A Service named `dsv41-adapters` over IPv6, and one named `dsv41-folded-fence` over UDP.
MORE = {"DSV41_ADAPTERS_SERVICE_HOST": "fd00::1", "DSV41_ADAPTERS_PORT": "tcp://[fd00::1]:80",
        "DSV41_FOLDED_FENCE_PORT_53_UDP": "udp://10.0.0.2:53", "DSV41_FOLDED_FENCE_PORT_53_UDP_PROTO": "udp"}


def test_service_links_are_ignored_and_named():
    environ = SERVICE | MORE | {"DSV41_FOLDED_FENCE": "1"}
    assert runtime.unknown_flags(environ) == []
    assert runtime.service_links(environ) == sorted(SERVICE | MORE)
    decision = runtime.decide(environ, names=(folded_fence.NAME,))
    assert not decision.refused and decision.outcomes[0].state == runtime.APPLIED


@pytest.mark.parametrize("name,value", [
    ("DSV41_FOLDED_FENSE", "1"),  # a near miss keeps being refused, beside service links
    ("DSV41_PORT", "1"), ("DSV41_PORT", "http://10.0.0.1:30000"), ("DSV41_SERVICE_HOST", "dsv41.example"),
    ("DSV41_SERVICE_PORT", "30000x"), ("DSV41_PORT_30000_TCP", "tcp://10.0.0.1:30001"),
    ("DSV41_PORT_30000_TCP_PROTO", "udp"), ("DSV41_PORT_30000_TCP_ADDR", "300.0.0.1"), ("DSV41_SERVICE_PORT", "0"),
    ("DSV41_PORT", "tcp://10.0.0.1:70000"),
])
def test_only_a_service_links_name_with_its_value_is_ignored(name, value):
    problems = runtime.unknown_flags(SERVICE | {name: value})
    assert len(problems) == 1 and problems[0].startswith(f"{name} is not a flag of this pack"), problems
    assert name not in runtime.service_links(SERVICE | {name: value})


def test_kubernetes_service_links_do_not_stop_the_server():
    """doctor --strict and the launch in a pod of a namespace with a Service `dsv41`: they go on,
    and the launcher says once which variables it ignored."""
    env = engine_env("0.5.23", DSV41_FOLDED_FENCE="1", **SERVICE)
    doctor = zygote.run([python(), "entrypoint.py", "doctor", "--strict"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=240)
    assert doctor.returncode == 0, doctor.stdout[-2000:] + doctor.stderr[-2000:]
    assert "flags: ignored DSV41_PORT, DSV41_PORT_30000_TCP, " in doctor.stdout
    launch = zygote.run([python(), "entrypoint.py", "python", "-c", "print('ran')"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=240)
    assert launch.returncode == 0 and launch.stdout == "ran\n", launch.stderr[-2000:]
    ignored = [line for line in untimed(launch.stderr) if " ignored DSV41_" in line]
    assert len(ignored) == 1 and ignored[0].startswith("[sglang-adapters] pid=") and "Kubernetes service links" in ignored[0]


# --- the master switch takes every flag's off words ---------------------------------------------

@pytest.mark.parametrize("value", ["off", "OFF", "Off", "0", "false", "FALSE", "none", "None", "no", "N"])
def test_the_master_switch_takes_the_off_words_of_every_flag(value):
    decision = runtime.decide({"DSV41_ADAPTERS": value, "DSV41_FOLDED_FENCE": "1"})
    assert decision.switched_off and not decision.refused and not decision.enabled


@pytest.mark.parametrize("value", ["on", "1", "true", "yes", "", " off", "disabled"])
def test_any_other_master_switch_value_is_refused(value):
    decision = runtime.decide({"DSV41_ADAPTERS": value})
    assert not decision.switched_off and decision.refused
    (problem,) = decision.flag_errors
    assert problem.startswith(f"DSV41_ADAPTERS={value!r} is not understood: set it to 0/off/false/none/no/n (any case)")


@pytest.mark.parametrize("value, form", [("json", "json"), ("JSON", "json"), ("Json", "json"), ("TEXT", "text")])
def test_the_log_switch_takes_any_case(value, form):
    from sglang_dsv41_adapters.framework import log

    assert runtime.switch_problems({"DSV41_ADAPTERS_LOG": value}) == []
    assert log.log_format({"DSV41_ADAPTERS_LOG": value}) == form
    (problem,) = runtime.switch_problems({"DSV41_ADAPTERS_LOG": "jsn"})
    assert problem.startswith("DSV41_ADAPTERS_LOG='jsn' is not understood")


# --- the pack's own settings: one prefix, the old names read as aliases ------------------------

def test_the_packs_settings_have_one_prefix_and_read_their_old_names():
    from sglang_dsv41_adapters.engine import proofs, settings
    from sglang_dsv41_adapters.folded_fence import accept_snapshot

    assert proofs.ENV == "DSV41_ADAPTERS_PROOF_CACHE" and accept_snapshot.PATH_ENV == "DSV41_ADAPTERS_SNAPSHOT_KERNEL"
    assert all(name.startswith("DSV41_ADAPTERS_") for name in settings.NAMES)
    # a setting under its new name is no unknown flag, and needs no note
    assert runtime.unknown_flags({"DSV41_ADAPTERS_PROOF_CACHE": "/tmp/p"}) == []
    assert runtime.ignored_note({"DSV41_ADAPTERS_PROOF_CACHE": "/tmp/p"}) == []
    # the old name is read where the new one is not set, and said
    old = {"SGLANG_ADAPTERS_PROOF_CACHE": "/tmp/old"}
    assert [str(p) for p in proofs.folders(old)] == ["/tmp/old"]
    (note,) = runtime.ignored_note(old)
    assert note.startswith("SGLANG_ADAPTERS_PROOF_CACHE is the old name of DSV41_ADAPTERS_PROOF_CACHE (read for now)")
    # the new name wins where both are set
    both = old | {"DSV41_ADAPTERS_PROOF_CACHE": "/tmp/new"}
    assert [str(p) for p in proofs.folders(both)] == ["/tmp/new"]
    assert "(ignored: the new name is set too)" in runtime.ignored_note(both)[0]
    assert settings.get(settings.SNAPSHOT_KERNEL, {"SGLANG_ADAPTERS_SNAPSHOT_KERNEL": "/k.so"}) == "/k.so"
