from __future__ import annotations

import pytest

from oomguard.errors import CollectorError
from oomguard.exporter.collectors.cgroup import CgroupCollector


@pytest.fixture
def meminfo(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       24576000 kB\nMemFree:        1000 kB\n")
    return str(path)


def v2(
    tmp_path, current="1048576", limit="4194304", events="low 0\nhigh 0\nmax 2\noom 1\noom_kill 3\n"
):
    d = tmp_path / "cg"
    d.mkdir()
    (d / "memory.current").write_text(current + "\n")
    (d / "memory.max").write_text(limit + "\n")
    (d / "memory.events").write_text(events)
    return d


def test_cgroup_v2(tmp_path, meminfo):
    r = CgroupCollector("vllm", str(v2(tmp_path)), "h", meminfo_path=meminfo).collect()
    assert (r.used, r.limit, r.oom_kills, r.version) == (1048576, 4194304, 3, 2)


def test_unlimited_reports_memtotal(tmp_path, meminfo):
    r = CgroupCollector("vllm", str(v2(tmp_path, limit="max")), "h", meminfo_path=meminfo).collect()
    assert r.limit == 24576000 * 1024


def test_cgroup_v1_layout(tmp_path, meminfo):
    mem = tmp_path / "memory"
    mem.mkdir()
    (mem / "memory.usage_in_bytes").write_text("500\n")
    (mem / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    r = CgroupCollector("self", str(tmp_path), "h", meminfo_path=meminfo).collect()
    assert (r.used, r.limit, r.oom_kills, r.version) == (500, 24576000 * 1024, 2, 1)


def test_missing_files_are_not_found(tmp_path):
    with pytest.raises(CollectorError) as exc:
        CgroupCollector("x", str(tmp_path / "absent"), "h").collect()
    assert exc.value.reason == "not_found"


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [({"current": "lots"}, "parse_error"), ({"events": "low 0\n"}, "parse_error")],
)
def test_garbage_is_a_parse_error(tmp_path, meminfo, kwargs, reason):
    with pytest.raises(CollectorError) as exc:
        CgroupCollector("x", str(v2(tmp_path, **kwargs)), "h", meminfo_path=meminfo).collect()
    assert exc.value.reason == reason
