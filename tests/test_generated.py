"""Generated files are committed and must equal what the generators produce now."""

from __future__ import annotations

import shutil

from oomguard.cli import generated_files, main
from oomguard.generated import sync


def test_committed_files_match_their_generators(repo_root):
    drift = sync(repo_root, generated_files(), check=True)
    assert drift == [], f"run `make generate` and commit: {drift}"


def test_drift_is_detected_and_repaired(repo_root, tmp_path, capsys):
    files = generated_files()
    for rel in files:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(repo_root / rel, tmp_path / rel)
    victim = next(iter(files))
    (tmp_path / victim).write_text("# edited by hand\n")
    assert main(["generate", "--root", str(tmp_path), "--check"]) == 1
    assert f"differs: {victim}" in capsys.readouterr().out
    assert main(["generate", "--root", str(tmp_path)]) == 0
    assert main(["generate", "--root", str(tmp_path), "--check"]) == 0


def test_thresholds_file_changes_the_rules(tmp_path):
    t = tmp_path / "t.yaml"
    t.write_text("kv_usage_high_ratio: 0.8\nruntime_url: x\n")
    assert main(["generate", "--root", str(tmp_path), "--thresholds", str(t)]) == 2
    t.write_text("kv_usage_high_ratio: 0.8\n")
    assert main(["generate", "--root", str(tmp_path), "--thresholds", str(t)]) == 0
    assert (
        "max without (pod) (oomguard_vllm_kv_cache_usage_ratio) > 0.8"
        in (tmp_path / "alerts/oomguard/alerts/generated/oomguard.rules.yaml").read_text()
    )


def test_job_names_and_cluster_label_flow_into_rules_configs_and_manifests(tmp_path):
    """One thresholds file sets the names on both deployments: the rules select exactly the
    jobs the single-box config scrapes and the Kubernetes PodMonitors relabel to."""
    import yaml

    t = tmp_path / "t.yaml"
    t.write_text(
        "exporter_job: gpu-exporter\nremediator_job: gpu-fixer\ncluster_label: k8s_cluster\n"
    )
    assert main(["generate", "--root", str(tmp_path), "--thresholds", str(t)]) == 0
    rules = (tmp_path / "alerts/oomguard/alerts/generated/oomguard.rules.yaml").read_text()
    assert 'job="gpu-exporter"' in rules and 'job="gpu-fixer"' in rules
    assert 'job="oomguard-exporter"' not in rules
    assert "by (k8s_cluster, " in rules
    prom = yaml.safe_load((tmp_path / "deploy/prometheus/prometheus.yml").read_text())
    assert {"gpu-exporter", "gpu-fixer"} <= {j["job_name"] for j in prom["scrape_configs"]}
    jobs = set()
    for name in ("exporter.yaml", "remediator.yaml"):
        for doc in yaml.safe_load_all((tmp_path / "deploy/kubernetes" / name).read_text()):
            if doc and doc["kind"] == "PodMonitor":
                for r in doc["spec"]["podMetricsEndpoints"][0]["relabelings"]:
                    if r["targetLabel"] == "job":
                        jobs.add(r["replacement"])
    assert jobs == {"gpu-exporter", "gpu-fixer"}
    fleet = (tmp_path / "dashboards/oomguard/dashboards/generated/oomguard-fleet.json").read_text()
    assert 'k8s_cluster=~\\"$cluster\\"' in fleet and 'job=\\"gpu-exporter\\"' in fleet
