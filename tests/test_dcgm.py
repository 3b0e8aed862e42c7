from __future__ import annotations

import pytest
from oomguard.exporter.collectors.dcgm import MIB, DcgmCollector
from oomguard.exporter.render import FamilyBuilder

from oomguard.errors import CollectorError
from tests.conftest import DCGM_K8S, DCGM_MIG

LABELS = 'gpu="0",UUID="GPU-x",pci_bus_id="00000000:18:00.0",device="nvidia0",modelName="H100"'


def collect_text(tmp_path, text: str):
    path = tmp_path / "dcgm.prom"
    path.write_text(text)
    return DcgmCollector("fallback-host", file=str(path)).collect()


def test_k8s_fixture_converts_mib_and_keeps_pod_usage_apart():
    reading = DcgmCollector("fallback", file=str(DCGM_K8S)).collect()
    by_gpu = {g.identity.gpu: g for g in reading.gpus}
    g0 = by_gpu["0"]
    assert g0.used == 73402 * MIB and g0.free == 7590 * MIB and g0.reserved == 567 * MIB
    assert g0.total == (73402 + 7590 + 567) * MIB  # FB_TOTAL is optional: derived
    assert g0.identity.hostname == "gpu-node-01"  # `Hostname` spelling (<= 4.5.x)
    assert by_gpu["1"].used == 1 * MIB
    assert [(p[2], p[4]) for p in reading.pods] == [
        ("vllm-llama3-70b-7d9c6b5f4-x2k8q", 73402 * MIB)
    ]
    assert dict((i.gpu, code) for i, code in reading.last_xid) == {"0": 0, "1": 31}


def test_mig_fixture_instances_are_separate_and_never_summed():
    reading = DcgmCollector("fallback", file=str(DCGM_MIG)).collect()
    assert sorted(g.identity.gpu_instance_id for g in reading.gpus) == ["2", "9"]
    assert all(g.identity.hostname == "gpu-node-07" for g in reading.gpus)  # lowercase label
    i2 = next(g for g in reading.gpus if g.identity.gpu_instance_id == "2")
    assert i2.used == 39180 * MIB and i2.free == 1204 * MIB
    assert i2.identity.gpu_instance_profile == "3g.40gb"
    assert not any(g.identity.gpu_instance_id == "" for g in reading.gpus)  # no made-up parent


def test_per_pod_series_never_summed_with_the_device_series(tmp_path):
    text = f"""# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{{{LABELS},Hostname="h"}} 30000
DCGM_FI_DEV_FB_USED{{{LABELS},Hostname="h",namespace="a",pod="p1",container="c"}} 10000
DCGM_FI_DEV_FB_USED{{{LABELS},Hostname="h",namespace="a",pod="p2",container="c"}} 20000
# TYPE DCGM_FI_DEV_FB_FREE gauge
DCGM_FI_DEV_FB_FREE{{{LABELS},Hostname="h"}} 50000
"""
    reading = collect_text(tmp_path, text)
    (gpu,) = reading.gpus
    assert gpu.used == 30000 * MIB  # the device series, not 60000
    assert sorted(p[2] for p in reading.pods) == ["p1", "p2"]


def test_blank_sentinels_are_missing_not_huge(tmp_path):
    text = f"""# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{{{LABELS}}} 9223372036854775794
# TYPE DCGM_FI_DEV_FB_FREE gauge
DCGM_FI_DEV_FB_FREE{{{LABELS}}} 1000
# TYPE DCGM_FI_DEV_XID_ERRORS gauge
DCGM_FI_DEV_XID_ERRORS{{{LABELS}}} 2147483632
"""
    reading = collect_text(tmp_path, text)
    (gpu,) = reading.gpus
    assert gpu.used is None and gpu.total is None and gpu.free == 1000 * MIB
    assert reading.invalid["blank_sentinel"] == 2
    assert reading.last_xid == []
    assert gpu.identity.hostname == "fallback-host"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('DCGM_FI_DEV_FB_USED{gpu="0" 12\n', "parse_error"),
        ('# TYPE DCGM_FI_DEV_GPU_TEMP gauge\nDCGM_FI_DEV_GPU_TEMP{gpu="0"} 40\n', "no_data"),
        ("", "no_data"),
    ],
)
def test_bad_input_is_a_collector_error(tmp_path, text, reason):
    with pytest.raises(CollectorError) as exc:
        collect_text(tmp_path, text)
    assert exc.value.reason == reason


def test_missing_file_is_not_found(tmp_path):
    with pytest.raises(CollectorError) as exc:
        DcgmCollector("h", file=str(tmp_path / "nope")).collect()
    assert exc.value.reason == "not_found"


def test_reads_from_an_http_endpoint(local_server):
    server = local_server(DCGM_K8S.read_text())
    collector = DcgmCollector("h", url=server.url, timeout=2)
    reading = collector.collect()
    assert len(reading.gpus) == 2
    out = FamilyBuilder()
    collector.families(reading, out)
    names = {f.spec.name for f in out.families()}
    assert names == {"oomguard_gpu_pod_memory_used_bytes", "oomguard_gpu_last_xid"}
