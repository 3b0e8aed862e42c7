"""Durations and sizes take units everywhere (oomguard.units): every config key named `*_seconds`
or `*_bytes`, every duration flag; a plain number where the name says the unit; a clear error
naming the key or flag otherwise."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from oomguard.config import validate
from oomguard.errors import ConfigError
from oomguard.exporter.config import ExporterConfig
from oomguard.remediator.config import RemediatorConfig, load
from oomguard.thresholds import AlertThresholds
from oomguard.units import format_duration, format_size, parse_duration, parse_size

GIB = 2**30


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("1s", 1.0),
        ("2.5m", 150.0),
        ("1h30m", 5400.0),
        ("1d", 86400.0),
        ("30", 30.0),
        ("0.25", 0.25),
        (" 10 s ", 10.0),
        ("1H", 3600.0),
    ],
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "s", "1x", "-1s", "1e9s", "ten seconds", "1s2", "∞", "1" * 80])
def test_bad_durations_name_the_forms(bad):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)


@pytest.mark.parametrize(
    ("text", "size"),
    [("2GiB", 2 * GIB), ("24GB", 24 * 10**9), ("512MiB", 512 * 2**20), ("2Gi", 2 * GIB)],
)
def test_sizes(text, size):
    assert parse_size(text) == size


def test_a_plain_size_needs_the_name_to_say_bytes():
    """`--gpu-memory 80`: GB or GiB? Refused with the spellings to choose from; a key named
    `*_bytes` says the unit, so there 80 is 80 bytes."""
    with pytest.raises(ValueError, match=r"has no unit.*80GiB, 80GB"):
        parse_size("80")
    assert parse_size("80", plain=True) == 80
    for bad in ("2G", "lots", "-1GiB", "1.5.5GiB"):
        with pytest.raises(ValueError):
            parse_size(bad)


@given(st.floats(min_value=0.001, max_value=10**7, allow_nan=False))
def test_formatted_durations_parse_back(seconds):
    seconds = round(seconds, 3)
    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds, rel=1e-9)


def test_formatted_sizes():
    assert format_size(2 * GIB) == "2GiB" and format_size(1536) == "1.5KiB"
    assert format_size(100) == "100B"


# -- configs ------------------------------------------------------------------------------------
def test_exporter_config_takes_units_in_every_section():
    data = {
        "interval_seconds": "500ms",
        "nvml": {"timeout_seconds": "1s"},
        "vllm": [{"name": "a", "url": "http://127.0.0.1:1/metrics", "timeout_seconds": "1.5s"}],
        "allocator": {"stale_after_seconds": "1m"},
        "pressure": {"floor_bytes": "2GiB", "event_hold_seconds": "2m"},
    }
    config = validate(ExporterConfig, data, "test")
    assert config.interval_seconds == 0.5
    assert config.nvml.timeout_seconds == 1.0
    assert config.vllm[0].timeout_seconds == 1.5
    assert config.allocator.stale_after_seconds == 60.0
    assert config.pressure.floor_bytes == 2 * GIB and config.pressure.event_hold_seconds == 120.0
    # plain numbers keep meaning seconds and bytes
    config = validate(ExporterConfig, {"interval_seconds": 2, "pressure": {"floor_bytes": 1}}, "t")
    assert config.interval_seconds == 2.0 and config.pressure.floor_bytes == 1


def test_a_unit_error_names_the_dotted_key():
    data = {"vllm": [{"name": "a", "url": "http://x/metrics", "timeout_seconds": "soon"}]}
    with pytest.raises(ConfigError, match=r"vllm\.0\.timeout_seconds: not a duration: 'soon'"):
        validate(ExporterConfig, data, "test")
    with pytest.raises(ConfigError, match=r"pressure\.floor_bytes: not a size"):
        validate(ExporterConfig, {"pressure": {"floor_bytes": "big"}}, "test")


def test_ranges_still_hold_after_units():
    with pytest.raises(ConfigError, match="interval_seconds"):
        validate(ExporterConfig, {"interval_seconds": "50ms"}, "test")  # below 0.1 s


def test_remediator_config_takes_units(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "auth": {"allow_unauthenticated": True},
                "targets": [
                    {
                        "name": "a",
                        "url": "http://127.0.0.1:1",
                        "restart": {
                            "supervisor": {"url": "http://127.0.0.1:2"},
                            "ready_timeout_seconds": "15m",
                        },
                    }
                ],
                "reconcile_seconds": "500ms",
                "max_body_bytes": "2MiB",
                "policy": {"readmit_stall_seconds": "5m"},
                "safety": {"cooldown_seconds": "10s", "window_seconds": "1h"},
                "flags": {"walk_back_after_seconds": "1h"},
                "standalone": {"exporters": ["http://127.0.0.1:3/metrics"], "interval_seconds": 1},
            }
        )
    )
    config = load(path)
    assert isinstance(config, RemediatorConfig)
    assert config.reconcile_seconds == 0.5 and config.max_body_bytes == 2 * 2**20
    assert config.targets[0].restart and config.targets[0].restart.ready_timeout_seconds == 900
    assert config.policy.readmit_stall_seconds == 300 and config.safety.window_seconds == 3600
    assert config.flags.walk_back_after_seconds == 3600


def test_alert_thresholds_take_sizes():
    t = validate(AlertThresholds, {"fragmentation_growth_bytes": "4GiB"}, "test")
    assert t.fragmentation_growth_bytes == 4 * GIB


# -- flags --------------------------------------------------------------------------------------
def test_interval_flag_takes_a_duration(tmp_path):
    from oomguard.cli import build_parser, exporter_config_from_args

    args = build_parser().parse_args(["exporter", "--no-nvml", "--interval", "500ms"])
    assert exporter_config_from_args(args).interval_seconds == 0.5
    args = build_parser().parse_args(["exporter", "--no-nvml", "--interval", "2"])
    assert exporter_config_from_args(args).interval_seconds == 2.0
    r = subprocess.run(
        [sys.executable, "-m", "oomguard", "exporter", "--interval", "soon"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--interval: not a duration: 'soon'" in r.stderr, r.stderr


def test_serve_flags_take_durations_and_sizes():
    from oomguard.cli import build_parser

    args = build_parser().parse_args(
        [
            "serve",
            "--crash-window",
            "15m",
            "--restart-delay",
            "500ms",
            "--stop-timeout",
            "90",
            "--log-max-size",
            "10MiB",
            "--",
            "vllm",
            "serve",
            "m",
        ]
    )
    assert (args.crash_window, args.restart_delay, args.stop_timeout) == (900.0, 0.5, 90.0)
    assert args.log_max_size == 10 * 2**20


# -- bounds: a value that passes --check must not overflow at the start -------------------------
HUGE = "9" * 60 + "w"  # 64 characters of valid grammar: 6e65 seconds


@pytest.mark.parametrize("value", [HUGE, "3651d", 10**20, 1e300])
def test_a_duration_beyond_ten_years_is_refused_with_or_without_a_unit(value):
    from oomguard.units import config_value

    with pytest.raises(ValueError, match="too large"):
        config_value("reconcile_seconds", value)


@pytest.mark.parametrize("value", ["9" * 60 + "TiB", "1025TiB", 10**20])
def test_a_size_beyond_a_pebibyte_is_refused(value):
    from oomguard.units import config_value

    with pytest.raises(ValueError, match="too large"):
        config_value("max_bytes", value)


@pytest.mark.parametrize("value", [f'"{HUGE}"', "99999999999999999999"])
def test_a_remediator_interval_that_would_overflow_fails_check_not_the_start(tmp_path, value):
    """Found: reconcile_seconds "999...9w" (or a 20-digit plain number) passed `remediator
    --check` and the start then died with a traceback (OverflowError in the scheduler)."""
    (tmp_path / "token").write_text("t0ken\n")
    config = tmp_path / "remediator.yaml"
    config.write_text(
        f"listen: 127.0.0.1:1\nauth: {{bearer_token_file: {tmp_path / 'token'}}}\n"
        "targets: [{name: a, url: 'http://127.0.0.1:1'}]\n"
        f"audit_log: {tmp_path / 'audit.jsonl'}\nreconcile_seconds: {value}\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "oomguard", "remediator", "--config", str(config), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "reconcile_seconds" in r.stderr and "too large" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_duration_flag_that_would_overflow_is_refused():
    r = subprocess.run(
        [sys.executable, "-m", "oomguard", "status", "--timeout", HUGE, "--exporter", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--timeout" in r.stderr and "too large" in r.stderr
