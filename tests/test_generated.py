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
        "oomguard_vllm_kv_cache_usage_ratio > 0.8"
        in (tmp_path / "alerts/generated/oomguard.rules.yaml").read_text()
    )
