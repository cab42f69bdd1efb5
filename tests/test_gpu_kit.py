"""The kit for a rented GPU machine: the wheels it lacks, pinned like the rest, and the campaign script."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import ROOT, assert_clean_usage_error


def pins(path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[re.sub(r"[-_.]+", "-", name.lower())] = version
    return out


def test_gpu_wheels_pin_the_versions_requirements_pins():
    kit, req = pins(ROOT / "scripts" / "gpu-wheels.txt"), pins(ROOT / "requirements.txt")
    assert {"nbclient", "ipykernel", "jupytext", "nbformat", "diffusers"} <= set(kit)
    assert "torch" not in kit  # the GPU machine's own CUDA build is the one to measure
    differ = {name: (v, req[name]) for name, v in kit.items() if name in req and req[name] != v}
    assert not differ, differ


def campaign(*args: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_campaign"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_gpu_campaign_check_stage_rehearses_on_cpu(tmp_path):
    proc = campaign("--device", "cpu", "--out", str(tmp_path), "check", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = (tmp_path / "campaign.log").read_text()
    assert "end   check: exit 0" in log and "0 failure(s)" in log
    for name in ("nbclient", "ipykernel", "jupytext", "accelerate", "diffusers"):
        assert re.search(rf"^{name} \d", log, re.M), name  # every package the stages import is there


def test_gpu_campaign_bad_input(tmp_path):
    assert_clean_usage_error(campaign("dance", tmp_path=tmp_path), "unknown argument 'dance'")
    assert_clean_usage_error(campaign("--device", "tpu", "check", tmp_path=tmp_path), "--device takes cuda or cpu")
    assert_clean_usage_error(campaign(tmp_path=tmp_path), "name at least one stage")
