from __future__ import annotations

import pytest

from oomguard.cli import build_parser, exporter_config_from_args
from oomguard.errors import ConfigError


def config_from(tmp_path, yaml_text: str | None, *flags: str):
    argv = ["exporter"]
    if yaml_text is not None:
        path = tmp_path / "exporter.yaml"
        path.write_text(yaml_text)
        argv += ["--config", str(path)]
    return exporter_config_from_args(build_parser().parse_args([*argv, *flags]))


def test_defaults():
    c = exporter_config_from_args(build_parser().parse_args(["exporter"]))
    assert c.listen_address == ("0.0.0.0", 9848) and c.interval_seconds == 1.0
    assert c.nvml.enabled and not c.dcgm.enabled and c.vllm == []
    assert c.pressure.floor_bytes == 2 * 1024**3


def test_yaml_then_flags(tmp_path):
    c = config_from(
        tmp_path,
        """
interval_seconds: 0.5
vllm:
  - {name: a, url: "http://127.0.0.1:8000/metrics", gpus: ["0"]}
pressure: {floor_bytes: 1073741824}
""",
        "--interval",
        "0.2",
        "--vllm",
        "b=http://127.0.0.1:8001/metrics",
        "--no-nvml",
    )
    assert c.interval_seconds == 0.2
    assert [t.name for t in c.vllm] == ["a", "b"] and c.vllm[0].gpus == ["0"]
    assert not c.nvml.enabled and c.pressure.floor_bytes == 1024**3


@pytest.mark.parametrize(
    ("yaml_text", "flags", "message"),
    [
        ("intervall_seconds: 1\n", (), "intervall_seconds: Extra inputs are not permitted"),
        ("interval_seconds: 0.01\n", (), "interval_seconds"),
        ("listen: nowhere\n", (), "listen"),
        ("vllm: [{name: a, url: 'ftp://x'}]\n", (), "vllm.0.url"),
        ("vllm: [{name: 'a b', url: 'http://x'}]\n", (), "vllm.0.name"),
        (None, ("--vllm", "a=http://x", "--vllm", "a=http://y"), "duplicate vllm names"),
        ("[1, 2]\n", (), "top level must be a mapping"),
        ("a: [unclosed\n", (), "not valid YAML"),
        ("pressure: {headroom_pressure_ratio: 0.5}\n", (), "ordered"),
        ("dcgm: {url: 'http://x', file: '/f'}\n", (), "not both"),
    ],
)
def test_wrong_config_is_a_clear_error(tmp_path, yaml_text, flags, message):
    with pytest.raises(ConfigError, match=message):
        config_from(tmp_path, yaml_text, *flags)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match=r"absent\.yaml: no such file"):
        exporter_config_from_args(
            build_parser().parse_args(["exporter", "--config", str(tmp_path / "absent.yaml")])
        )


def test_shipped_example_config_is_valid(repo_root):
    c = exporter_config_from_args(
        build_parser().parse_args(
            ["exporter", "--config", str(repo_root / "deploy" / "exporter.example.yaml")]
        )
    )
    assert [t.name for t in c.vllm] == ["llama-3-8b-0", "llama-3-8b-1"]


def test_node_name_comes_from_flag_then_config_then_node_name_env(tmp_path, monkeypatch):
    import socket

    monkeypatch.setenv("NODE_NAME", "node-from-env")
    assert config_from(tmp_path, None).hostname == "node-from-env"
    assert config_from(tmp_path, "hostname: node-from-file\n").hostname == "node-from-file"
    flagged = config_from(tmp_path, "hostname: node-from-file\n", "--hostname", "node-from-flag")
    assert flagged.hostname == "node-from-flag"
    monkeypatch.setenv("NODE_NAME", "")  # set but empty (a missing fieldRef): the host name
    assert config_from(tmp_path, None).hostname == socket.gethostname()


@pytest.mark.parametrize("name", ["", "   ", "two words", "tab\there", "x" * 254, "new\nline"])
def test_a_hostname_that_cannot_name_a_node_is_refused(tmp_path, name):
    with pytest.raises(ConfigError, match="hostname"):
        config_from(tmp_path, f"hostname: {name!r}\n".replace("'", '"'))


@pytest.mark.parametrize("listen", ["127.0.0.1:²", "127.0.0.1:٩٠٠٠", "127.0.0.1:", "9848"])
def test_a_listen_port_must_be_ascii_digits(listen):
    from pydantic import ValidationError

    from oomguard.exporter.config import ExporterConfig

    with pytest.raises(ValidationError, match="host:port"):
        ExporterConfig.model_validate({"listen": listen})


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0),
        ("9848", 9848),
        ("007", 7),
        ("²", None),
        ("١٣", None),
        ("", None),
        ("-1", None),
        (" 5", None),
        ("5.0", None),
    ],
)
def test_only_ascii_decimal_digits_are_a_number(text, value):
    from oomguard.digits import decimal

    assert decimal(text) == value
