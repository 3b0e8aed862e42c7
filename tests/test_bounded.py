"""The bounded reader (oomguard.bounded): every refusal is one InputError with a fixed reason and a
one-line message naming the source, in bounded time, for every kind of hostile input."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest

from oomguard import bounded
from oomguard.bounded import REASONS, InputError, Limits

# Each check is bounded in time: a generous ceiling on a loaded 2-core box, far below a hang.
QUICK = 10.0


def refused(reason: str, fn, *args, **kwargs) -> InputError:
    start = time.monotonic()
    with pytest.raises(InputError) as caught:
        fn(*args, **kwargs)
    assert time.monotonic() - start < QUICK
    exc = caught.value
    assert exc.reason == reason, (exc.reason, str(exc))
    assert exc.reason in REASONS
    assert "\n" not in str(exc) and str(exc).startswith(f"{exc.source}: ")
    assert isinstance(exc, ValueError)  # callers that catch ValueError keep working
    return exc


# -- file type ----------------------------------------------------------------------------------
def test_regular_file_is_read(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"hello")
    assert bounded.read_bytes(f) == b"hello"
    assert bounded.read_text(f) == "hello"


def test_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    exc = refused("not_regular_file", bounded.read_bytes, fifo)
    assert "FIFO" in str(exc)


def test_device_is_refused():
    exc = refused("not_regular_file", bounded.read_bytes, "/dev/zero")
    assert "device" in str(exc)


def test_socket_is_refused(tmp_path):
    path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        refused("not_regular_file", bounded.read_bytes, path)


def test_directory_and_missing_file(tmp_path):
    assert "is a directory" in str(refused("is_directory", bounded.read_json, tmp_path))
    assert "no such file" in str(refused("not_found", bounded.read_json, tmp_path / "nope"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path):
    f = tmp_path / "secret"
    f.write_text("x")
    f.chmod(0)
    refused("permission_denied", bounded.read_bytes, f)


def test_symlinks_followed_unless_refused(tmp_path):
    target = tmp_path / "target"
    target.write_text("{}")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert bounded.read_json(link) == {}  # a Kubernetes Secret mount is a chain of links
    refused("symlink", bounded.read_bytes, link, follow_symlinks=False)
    (tmp_path / "to-fifo").symlink_to(tmp_path / "fifo")
    os.mkfifo(tmp_path / "fifo")
    refused("not_regular_file", bounded.read_bytes, tmp_path / "to-fifo")


def test_dir_fd_reads_relative_to_an_open_directory(tmp_path):
    (tmp_path / "a.json").write_text('{"a": 1}')
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert bounded.read_json("a.json", dir_fd=fd, follow_symlinks=False) == {"a": 1}
        refused("not_found", bounded.read_json, "b.json", dir_fd=fd)
    finally:
        os.close(fd)


# -- size ---------------------------------------------------------------------------------------
def test_size_limit(tmp_path):
    f = tmp_path / "big"
    f.write_bytes(b"x" * 1001)
    refused("too_large", bounded.read_bytes, f, Limits(max_bytes=1000))
    assert len(bounded.read_bytes(f, Limits(max_bytes=1001))) == 1001


def test_a_file_that_grows_while_read_is_cut_at_the_limit(tmp_path, monkeypatch):
    f = tmp_path / "growing"
    f.write_bytes(b"x" * 10)
    real_fstat = os.fstat

    def grow_after_fstat(fd):
        st = real_fstat(fd)
        with f.open("ab") as fh:
            fh.write(b"y" * 5000)
        return st

    monkeypatch.setattr(os, "fstat", grow_after_fstat)
    refused("too_large", bounded.read_bytes, f, Limits(max_bytes=1000))


# -- text and JSON ------------------------------------------------------------------------------
def test_bad_utf8_names_the_byte(tmp_path):
    f = tmp_path / "config.json"
    f.write_bytes(b'{"a": "\xff"}')
    exc = refused("not_utf8", bounded.read_json, f)
    assert str(f) in str(exc) and "byte 7" in str(exc)


def test_byte_order_mark_is_dropped(tmp_path):
    f = tmp_path / "config.json"
    f.write_bytes(b'\xef\xbb\xbf{"a": 1}')
    assert bounded.read_json(f) == {"a": 1}


@pytest.mark.parametrize("depth", [65, 900, 100_000])
def test_deep_nesting(depth):
    refused("too_deep", bounded.parse_json, "[" * depth + "]" * depth, "body")
    refused("too_deep", bounded.parse_json, '{"a":' * depth + "1" + "}" * depth, "body")


def test_nesting_at_the_limit_is_fine():
    assert bounded.parse_json("[" * 64 + "]" * 64, "body") is not None
    refused("too_deep", bounded.parse_json, "[" * 65 + "]" * 65, "body")


@pytest.mark.parametrize("digits", [41, 400, 5000, 100_000])
def test_long_integers(digits):
    exc = refused("number_too_long", bounded.parse_json, '{"n": ' + "9" * digits + "}", "b")
    assert f"{digits:,} digits" in str(exc)
    refused("number_too_long", bounded.parse_json, '{"n": -' + "9" * digits + "}", "b")
    refused("number_too_long", bounded.parse_json, '{"n": 0.' + "1" * digits + "}", "b")


def test_forty_digits_and_hf_sentinel_are_fine():
    doc = bounded.parse_json('{"a": 1000000000000000019884624838656, "b": ' + "9" * 40 + "}", "b")
    assert doc["a"] == 1000000000000000019884624838656


@pytest.mark.parametrize("text", ['{"a": NaN}', '{"a": Infinity}', '{"a": -Infinity}', "[1e999]"])
def test_non_finite_numbers(text):
    refused("not_finite", bounded.parse_json, text, "b")


def test_escaped_lone_surrogate_is_not_utf8():
    refused("not_utf8", bounded.parse_json, '{"target": "\\udc80"}', "b")
    refused("not_utf8", bounded.parse_json, '{"\\uDC80": 1}', "b")
    assert bounded.parse_json('{"a": "\\ud83d\\ude00"}', "b") == {"a": "\U0001f600"}


@pytest.mark.parametrize("text", ["", "{", '{"a": 1,}', "[1] [2]", "\x00"])
def test_not_json(text):
    assert "not JSON" in str(refused("not_json", bounded.parse_json, text, "b"))


_TRICKY_JSON = [
    '{"a": 1, "b": [2, 3.5, "x"], "c": {"d": null}}',
    "7",
    "-" + "9" * 20,
    "9" * 21,
    "-" + "9" * 21,
    '{"a": 99999999999999999999, "b": -99999999999999999999}',
    '{"a": 100000000000000000000}',
    '{"a": [1, ' + "9" * 5000 + "]}",
    '{"a": ' + "9" * 30 + ', "b": 1e999}',
    '{"a": 1e999, "b": ' + "9" * 30 + "}",
    '{"a": ' + "9" * 30 + ", }",
    '{"a": 0.' + "1" * 25 + "}",
    '{"a": NaN, "b": ' + "9" * 30 + "}",
    "[-Infinity]",
    "[1e308, 1e309]",
    '"\\udc80"',
    '{"\\udc80": 1, "b": ' + "9" * 30 + "}",
    "\ufeff[1]",
    "[" * 5 + "1" + "]" * 5,
    "[" * 5 + "9" * 30 + "]" * 5,
    "[1, 2, 3, 4, 5, 6]",
    "{",
    "",
]


def _outcome(text: str | bytes, limits: Limits) -> object:
    try:
        return ("doc", bounded.parse_json(text, "b", limits))
    except InputError as exc:
        return (exc.reason, str(exc))


@pytest.mark.parametrize("as_bytes", [True, False])  # a str's scalars are all walked: bytes'
@pytest.mark.parametrize("text", _TRICKY_JSON)  # integers only by the quick parse's walk
def test_the_quick_json_parse_answers_as_the_exact_one(text, as_bytes, monkeypatch):
    # parse_json tries a quicker decoder first (integers read by C, checked after): whatever
    # it answers (document, or reason and words) is the exact parse's answer
    limits = Limits(max_digits=20, max_depth=4, max_values=5)
    if as_bytes:
        text = text.encode()
    quick = _outcome(text, limits)

    class Refuses:
        def decode(self, text):
            raise ValueError("the quick decoder is off")

    monkeypatch.setattr(bounded, "_quick_decoder", lambda limits: Refuses())
    assert quick == _outcome(text, limits)


def test_a_plain_document_takes_the_quick_parse(monkeypatch):
    # the exact parse (json.loads with an integer hook) only for what the quick one refuses
    calls = []
    real = bounded.json.loads
    monkeypatch.setattr(bounded.json, "loads", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert bounded.parse_json(b'{"pid": 12, "n": [1, 2.5], "s": "x"}', "b") == {
        "pid": 12,
        "n": [1, 2.5],
        "s": "x",
    }
    assert calls == []
    refused("number_too_long", bounded.parse_json, "[" + "9" * 50 + "]", "b")
    assert calls == [1]


def test_too_many_values():
    refused(
        "too_many_values",
        bounded.parse_json,
        "[" + ",".join(["1"] * 2000) + "]",
        "b",
        Limits(max_values=1000),
    )


def test_parse_json_keeps_its_size_limit():
    refused(
        "too_large", bounded.parse_json, b"[" + b"1," * 600 + b"1]", "b", Limits(max_bytes=1000)
    )


def test_a_large_valid_document_is_quick():
    text = '{"a": [' + ",".join(['{"x": 1, "y": "z"}'] * 40_000) + "]}"
    start = time.monotonic()
    assert len(bounded.parse_json(text, "b", Limits(max_bytes=2 * bounded.MIB))["a"]) == 40_000
    assert time.monotonic() - start < QUICK


# -- YAML ---------------------------------------------------------------------------------------
def test_yaml_refusals():
    refused("number_too_long", bounded.parse_yaml, "port: " + "9" * 5000, "c.yaml")
    refused("number_too_long", bounded.parse_yaml, "port: " + "9" * 400, "c.yaml")
    refused("too_deep", bounded.parse_yaml, "a: " + "[" * 100_000, "c.yaml")
    refused("too_deep", bounded.parse_yaml, "a: " + "[" * 100 + "]" * 100, "c.yaml")
    refused("not_finite", bounded.parse_yaml, "interval_seconds: .nan", "c.yaml")
    refused("not_yaml", bounded.parse_yaml, "a: [b", "c.yaml")
    refused("not_yaml", bounded.parse_yaml, "when: 2026-13-45", "c.yaml")
    refused("not_utf8", bounded.parse_yaml, b"a: \xff", "c.yaml")


def test_yaml_alias_bomb_is_refused_quickly():
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        prev, name = chr(96 + i), chr(97 + i)
        lines.append(f"{name}: &{name} [{', '.join(['*' + prev] * 10)}]")
    refused("too_many_values", bounded.parse_yaml, "\n".join(lines), "bomb.yaml")


def test_yaml_ordinary_config(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("listen: 127.0.0.1:9848\nvllm:\n  - {name: a, url: 'http://x/metrics'}\n")
    assert bounded.read_yaml(f)["vllm"][0]["name"] == "a"


# -- streams ------------------------------------------------------------------------------------
def test_stream_size_and_deadline():
    assert bounded.collect([b"ab", b"cd"], "http://x") == b"abcd"
    refused(
        "too_large",
        bounded.collect,
        iter([b"x" * 600, b"x" * 600]),
        "http://x",
        Limits(max_bytes=1000),
    )

    def slow():
        yield b"a"
        time.sleep(0.3)
        yield b"b"

    exc = refused("timeout", bounded.collect, slow(), "http://x", Limits(timeout=0.1))
    assert "http://x" in str(exc)


def test_async_stream():
    async def chunks(n):
        for _ in range(n):
            yield b"x" * 100

    assert asyncio.run(bounded.acollect(chunks(3), "u")) == b"x" * 300
    with pytest.raises(InputError) as caught:
        asyncio.run(bounded.acollect(chunks(20), "u", Limits(max_bytes=1000)))
    assert caught.value.reason == "too_large"


def test_reading_never_hangs_on_a_fifo_with_a_slow_writer(tmp_path):
    """Even with a writer attached, a FIFO is refused, never waited on."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    opened = threading.Event()

    def writer():
        fd = os.open(fifo, os.O_RDWR)  # holds both ends open: a reader would wait forever
        opened.set()
        time.sleep(2)
        os.close(fd)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    assert opened.wait(5)
    refused("not_regular_file", bounded.read_json, fifo)
    t.join(5)
