from __future__ import annotations

import pytest

from oomguard.errors import CollectorError
from oomguard.exporter.collectors.dcgm import MIB, DcgmCollector
from oomguard.exporter.render import FamilyBuilder
from tests.conftest import DCGM_K8S, DCGM_MIG, FIXTURES

DCGM_OLD_NAMESPACE = FIXTURES / "dcgm" / "h100x2-old-namespace.constructed.prom"
DCGM_A100_MIG_REAL = FIXTURES / "dcgm" / "a100-mig-gpu-operator.real.prom"
DCGM_T4_POD_REAL = FIXTURES / "dcgm" / "t4-whole-gpu-pod.real.prom"

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
    assert g0.identity.hostname == "fallback"  # the node name is ours, never dcgm's label
    assert by_gpu["1"].used == 1 * MIB
    assert [(p[2], p[4]) for p in reading.pods] == [
        ("vllm-llama3-70b-7d9c6b5f4-x2k8q", 73402 * MIB)
    ]
    assert dict((i.gpu, code) for i, code in reading.last_xid) == {"0": 0, "1": 31}


def test_mig_fixture_instances_are_separate_and_never_summed():
    reading = DcgmCollector("fallback", file=str(DCGM_MIG)).collect()
    assert sorted(g.identity.gpu_instance_id for g in reading.gpus) == ["2", "9"]
    assert all(g.identity.hostname == "fallback" for g in reading.gpus)  # not dcgm's label
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


def test_old_namespace_labels_keep_two_gpus_apart_and_map_pods():
    # Before: `uuid` was not read, both GPUs had UUID "" and merged into one; GPU 1 vanished.
    reading = DcgmCollector("node-a", file=str(DCGM_OLD_NAMESPACE)).collect()
    by_uuid = {g.identity.uuid: g for g in reading.gpus}
    assert set(by_uuid) == {
        "GPU-3f7c1a2e-5b1d-4c0e-9a7f-2d6b8e4c1a90",
        "GPU-8a2d4c6e-1f3b-4e5d-8c7a-9b0e1d2c3f45",
    }
    assert by_uuid["GPU-3f7c1a2e-5b1d-4c0e-9a7f-2d6b8e4c1a90"].used == 73402 * MIB
    assert by_uuid["GPU-8a2d4c6e-1f3b-4e5d-8c7a-9b0e1d2c3f45"].used == 1 * MIB
    ((identity, namespace, pod, container, used),) = reading.pods
    assert identity.uuid == "GPU-3f7c1a2e-5b1d-4c0e-9a7f-2d6b8e4c1a90"
    assert (namespace, pod, container, used) == (
        "llm-serving",
        "vllm-llama3-70b-7d9c6b5f4-x2k8q",
        "vllm",
        73402 * MIB,
    )


def test_the_node_name_is_the_exporters_not_the_dcgm_exporter_pods():
    # Real GPU Operator capture: Hostname is "nvidia-dcgm-exporter-q28k4", the exporter's pod.
    assert 'Hostname="nvidia-dcgm-exporter-q28k4"' in DCGM_A100_MIG_REAL.read_text()
    reading = DcgmCollector("gpu-node-7", file=str(DCGM_A100_MIG_REAL)).collect()
    assert {g.identity.hostname for g in reading.gpus} == {"gpu-node-7"}
    used = {g.identity.gpu_instance_id: g.used for g in reading.gpus}
    assert used == {"7": 98 * MIB, "9": 4384 * MIB, "5": 153 * MIB}
    profiles = sorted(g.identity.gpu_instance_profile for g in reading.gpus)
    assert profiles == ["1g.5gb", "1g.5gb", "2g.10gb"]
    assert reading.pods == []  # pod="" labels: no pod on these instances


def test_real_capture_where_every_series_carries_the_pod():
    reading = DcgmCollector("ip-172-20-10-26", file=str(DCGM_T4_POD_REAL)).collect()
    (gpu,) = reading.gpus
    assert (gpu.used, gpu.free) == (120 * MIB, 14796 * MIB)
    assert gpu.identity.model_name == "Tesla T4"
    assert [(p[1], p[2], p[3]) for p in reading.pods] == [
        ("runai-pa", "burn-whole-0-0", "burn-whole")
    ]


def test_gpus_without_any_uuid_label_are_not_merged(tmp_path):
    text = """# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0",device="nvidia0"} 100
DCGM_FI_DEV_FB_USED{gpu="1",device="nvidia1"} 200
"""
    reading = collect_text(tmp_path, text)
    assert sorted(g.used for g in reading.gpus) == [100 * MIB, 200 * MIB]
    assert len({g.identity.key for g in reading.gpus}) == 2


def test_a_repeated_series_is_counted_and_read_once(tmp_path):
    line = f'DCGM_FI_DEV_FB_USED{{{LABELS},pod="p",namespace="n",container="c"}} 100\n'
    reading = collect_text(tmp_path, "# TYPE DCGM_FI_DEV_FB_USED gauge\n" + line + line)
    assert [p[4] for p in reading.pods] == [100 * MIB]
    assert reading.invalid == {"duplicate_series": 1}


def test_two_device_series_for_one_gpu_keep_the_first(tmp_path):
    text = f"""# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{{{LABELS},Hostname="dcgm-pod-a"}} 100
DCGM_FI_DEV_FB_USED{{{LABELS},Hostname="dcgm-pod-b"}} 70000
"""
    (gpu,) = collect_text(tmp_path, text).gpus
    assert gpu.used == 100 * MIB
    assert collect_text(tmp_path, text).invalid == {"duplicate_gpu_series": 1}


def test_the_dcgm_file_is_read_bounded_and_never_blocks(tmp_path, monkeypatch):
    import os
    import threading

    from oomguard.exporter.collectors import dcgm

    fifo = tmp_path / "fifo.prom"
    os.mkfifo(fifo)
    errors: list[str] = []

    def collect() -> None:
        try:
            DcgmCollector("h", file=str(fifo)).collect()
        except CollectorError as exc:
            errors.append(exc.reason)

    t = threading.Thread(target=collect, daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert errors == ["not_regular_file"]

    linked = tmp_path / "linked.prom"  # a mounted ConfigMap is a symlink: followed
    linked.symlink_to(DCGM_K8S)
    assert len(DcgmCollector("h", file=str(linked)).collect().gpus) == 2

    monkeypatch.setattr(dcgm, "DEFAULT_MAX_BYTES", 1000)
    with pytest.raises(CollectorError) as exc:
        DcgmCollector("h", file=str(DCGM_K8S)).collect()
    assert exc.value.reason == "too_large"

    (tmp_path / "bad.prom").write_bytes(b"\xff\xfe")
    with pytest.raises(CollectorError) as exc:
        DcgmCollector("h", file=str(tmp_path / "bad.prom")).collect()
    assert exc.value.reason == "not_utf8"

    with pytest.raises(CollectorError) as exc:
        DcgmCollector("h", file=str(tmp_path)).collect()
    assert exc.value.reason == "is_directory" and str(tmp_path) in str(exc.value)


@pytest.mark.parametrize("code", ["²", "١٣", "13.0", "-13", "", "0", "99999999999999999999"])
def test_an_xid_label_that_is_not_a_plain_decimal_is_ignored(code):
    """str.isdigit() accepts "²" and Arabic-Indic digits, which int() refuses or misreads."""
    from oomguard.exporter.collectors.dcgm import _xid_code

    assert _xid_code({"xid": code}) is None
    assert _xid_code({"xid": "79"}) == 79
