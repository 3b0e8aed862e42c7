"""Plugin pieces that need vLLM importable but no server: idempotent loading, auth rules,
the allocator publisher (with a stand-in for torch.cuda: no GPU here)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.vllm_server import require_vllm


def test_register_is_idempotent():
    require_vllm()
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    from oomguard.vllm_plugin.engine import UTILITIES, register

    register()
    schedule, preempt = Scheduler.schedule, Scheduler._preempt_request
    register()
    register()
    assert Scheduler.schedule is schedule and Scheduler._preempt_request is preempt
    assert not getattr(Scheduler.schedule.__wrapped__, "_oomguard_wrapper", False)
    for name in UTILITIES:
        assert callable(getattr(EngineCore, name))


class _Req:
    """The part of a Starlette Request that `authorize` reads: the raw ASGI headers."""

    def __init__(self, auth: str | bytes | None) -> None:
        raw = auth.encode("utf-8") if isinstance(auth, str) else auth
        self.scope = {"headers": [(b"authorization", raw)] if raw is not None else []}


@pytest.mark.parametrize(
    ("env", "header", "status"),
    [
        ({}, "Bearer anything", 403),  # no token configured: refuse
        ({"OOMGUARD_PLUGIN_ALLOW_UNAUTHENTICATED": "1"}, None, None),
        ({"OOMGUARD_PLUGIN_TOKEN": "t0k"}, "Bearer t0k", None),
        ({"OOMGUARD_PLUGIN_TOKEN": "t0k"}, "bearer t0k", None),
        ({"OOMGUARD_PLUGIN_TOKEN": "t0k"}, "Bearer t0", 401),
        ({"OOMGUARD_PLUGIN_TOKEN": "t0k"}, None, 401),
        ({"OOMGUARD_PLUGIN_TOKEN": "t0k"}, "Bearer tök", 401),  # non-ASCII: 401, not 400
        ({"OOMGUARD_PLUGIN_TOKEN": "t0k"}, b"Bearer \xff\xfe", 401),
        ({"OOMGUARD_PLUGIN_TOKEN": "tök"}, "Bearer tök", None),  # a UTF-8 token works
    ],
)
def test_authorize(monkeypatch, env, header, status):
    require_vllm()
    from fastapi import HTTPException

    from oomguard.vllm_plugin.api import authorize

    for key in (
        "OOMGUARD_PLUGIN_TOKEN",
        "OOMGUARD_PLUGIN_TOKEN_FILE",
        "OOMGUARD_PLUGIN_ALLOW_UNAUTHENTICATED",
    ):
        monkeypatch.delenv(key, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if status is None:
        authorize(_Req(header))  # type: ignore[arg-type]
    else:
        with pytest.raises(HTTPException) as exc:
            authorize(_Req(header))  # type: ignore[arg-type]
        assert exc.value.status_code == status


def test_token_file_is_reread(monkeypatch, tmp_path):
    require_vllm()
    from fastapi import HTTPException

    from oomguard.vllm_plugin.api import authorize

    monkeypatch.delenv("OOMGUARD_PLUGIN_TOKEN", raising=False)
    path = tmp_path / "token"
    path.write_text("first\n")
    monkeypatch.setenv("OOMGUARD_PLUGIN_TOKEN_FILE", str(path))
    authorize(_Req("Bearer first"))  # type: ignore[arg-type]
    path.write_text("second\n")  # a rotated Secret
    with pytest.raises(HTTPException):
        authorize(_Req("Bearer first"))  # type: ignore[arg-type]
    authorize(_Req("Bearer second"))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["fifo", "not_utf8", "directory", "device", "too_large"])
def test_a_hostile_token_file_is_no_token_not_a_hang_or_a_500(monkeypatch, tmp_path, kind):
    """Issue 25 item 3: the plugin's token file through the bounded reader. Before, a FIFO
    blocked the API server's event loop on the first mutating call (and at start-up), and bad
    UTF-8 raised UnicodeDecodeError: a 500 on every call."""
    require_vllm()
    from fastapi import HTTPException

    from oomguard.vllm_plugin.api import authorize

    monkeypatch.delenv("OOMGUARD_PLUGIN_TOKEN", raising=False)
    monkeypatch.delenv("OOMGUARD_PLUGIN_ALLOW_UNAUTHENTICATED", raising=False)
    path = tmp_path / "token"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "not_utf8":
        path.write_bytes(b"s3cret\xff\n")
    elif kind == "directory":
        path.mkdir()
    elif kind == "device":
        path = Path("/dev/zero")
    else:
        path.write_bytes(b"x" * (65 * 1024))
    monkeypatch.setenv("OOMGUARD_PLUGIN_TOKEN_FILE", str(path))
    with pytest.raises(HTTPException) as exc:
        authorize(_Req("Bearer s3cret"))  # type: ignore[arg-type]
    assert exc.value.status_code == 403  # mutating routes off, as with no token configured


class FakeCuda:
    """Stands in for torch.cuda where no GPU exists; returns what torch would."""

    def __init__(self) -> None:
        self.initialized = False
        self.empty_cache_calls = 0
        self.fail = False

    def is_initialized(self) -> bool:
        return self.initialized

    def current_device(self) -> int:
        return 0

    def memory_stats(self, device: int) -> dict[str, int]:
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {
            "allocated_bytes.all.current": 10,
            "reserved_bytes.all.current": 20,
            "allocated_bytes.all.peak": 11,
            "reserved_bytes.all.peak": 21,
            "inactive_split_bytes.all.current": 3,
            "num_alloc_retries": 1,
            "num_ooms": 0,
        }

    def get_device_properties(self, device: int) -> object:
        return type("Props", (), {"uuid": "3f7c1a2e-5b1d-4c0e-9a7f-2d6b8e4c1a90"})()

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1

    def mem_get_info(self, device: int) -> tuple[int, int]:
        return (5_000, 80_000)


def test_publisher_writes_handoff_files_only_once_cuda_is_up(tmp_path):
    from oomguard.handoff import AllocatorReport
    from oomguard.vllm_plugin.allocator import AllocatorPublisher

    cuda = FakeCuda()
    pub = AllocatorPublisher(
        cuda, str(tmp_path), gc_interval=60, target="llama", clock=lambda: 1000.0
    )
    assert pub.publish_once() is None and not list(tmp_path.iterdir())  # not a worker yet
    cuda.initialized = True
    path = pub.publish_once()
    report = AllocatorReport.from_json(path.read_text())
    assert (report.allocated_bytes, report.reserved_bytes, report.alloc_retries) == (10, 20, 1)
    assert report.device_uuid == "GPU-3f7c1a2e-5b1d-4c0e-9a7f-2d6b8e4c1a90"
    assert report.free_after_gc_bytes == 5_000 and cuda.empty_cache_calls == 1
    assert report.target == "llama"
    pub.publish_once()
    assert cuda.empty_cache_calls == 1  # GC only every gc_interval


def test_publisher_never_raises(tmp_path):
    from oomguard.vllm_plugin.allocator import AllocatorPublisher

    cuda = FakeCuda()
    cuda.initialized, cuda.fail = True, True
    pub = AllocatorPublisher(cuda, str(tmp_path))
    assert pub.publish_once() is None and pub.publish_once() is None


def test_no_cuda_means_no_publisher():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    import oomguard.vllm_plugin.allocator as allocator

    allocator._started = False
    assert allocator.install() is None


def test_publisher_thread_starts_and_stops(tmp_path):
    from oomguard.vllm_plugin.allocator import AllocatorPublisher

    cuda = FakeCuda()
    cuda.initialized = True
    pub = AllocatorPublisher(cuda, str(tmp_path), interval=0.05)
    pub.start()
    import time

    deadline = time.monotonic() + 5
    while not list(tmp_path.glob("pid-*.json")) and time.monotonic() < deadline:
        time.sleep(0.02)
    files = list(tmp_path.glob("pid-*.json"))
    assert files and json.loads(files[0].read_text())["schema"] == "oomguard.allocator.v1"
    pub.stop()
    assert not list(tmp_path.glob("pid-*.json"))  # removed on a clean stop
