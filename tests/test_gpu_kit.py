"""The kit for a rented GPU machine: the wheels it lacks, pinned like the rest, and the campaign script."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
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


# ---------------------------------------------------------------- what comes back is checked before it lands
def _unpacker(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("unpack_campaign_t", ROOT / "scripts" / "unpack_campaign.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ROOT", tmp_path / "checkout")
    return module


def _archive(tmp_path, members: dict):
    import io
    import tarfile

    path = tmp_path / "campaign.tgz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(info)
                continue
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


GOOD = json.dumps({"provenance": {"device_type": "cuda", "device_name": "H100"}, "numbers": {"a": 1},
                   "tables": {"t": {"columns": [["x", "B"]], "rows": [[1]]}}, "figures": ["t.svg"]}).encode()


@pytest.mark.parametrize("members, fragment", [
    ({"results/../../etc/cron.d/x.json": GOOD}, "outside results/ and notebooks/"),
    ({"/tmp/abs.json": GOOD}, "outside results/ and notebooks/"),
    ({"scripts/serve": b"#!/bin/sh"}, "outside results/ and notebooks/"),
    ({"results/lab/summary.json": None}, "not a plain file"),
    ({"results/lab/run.sh": b"x"}, "has no place in results/"),
    ({"results/lab/summary.json": b"{not json"}, "not a valid results file"),
    ({"results/lab/summary.json": json.dumps({"provenance": {"device_name": {"<img>": 1}}}).encode()},
     "plain values"),
    ({"results/lab/summary.json": json.dumps({"provenance": {}, "tables": {"t": {"columns": [["x", "B"]],
                                                                               "rows": [[1, 2]]}}}).encode()},
     "one per column"),
])
def test_an_archive_with_anything_out_of_place_is_refused_whole(tmp_path, monkeypatch, members, fragment):
    from labkit.config import UsageError

    unpack = _unpacker(tmp_path, monkeypatch)
    archive = _archive(tmp_path, {"results/ok/summary.json": GOOD, **members})
    with pytest.raises(UsageError, match=fragment):
        unpack.run(unpack.Config(archive=archive))
    assert not (tmp_path / "checkout").exists()  # nothing written, not even the good member


def test_a_good_archive_lands_in_results_and_notebooks(tmp_path, monkeypatch):
    unpack = _unpacker(tmp_path, monkeypatch)
    archive = _archive(tmp_path, {"results/lab/summary.json": GOOD, "notebooks/lab.ipynb": b"{}"})
    assert unpack.run(unpack.Config(archive=archive)) == ["results/lab/summary.json", "notebooks/lab.ipynb"]
    assert (tmp_path / "checkout" / "results" / "lab" / "summary.json").read_bytes() == GOOD


def test_gpu_kit_refuses_arguments_in_one_line_before_any_download():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_kit"), "--out", "x"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHON="/nonexistent/python"))
    assert_clean_usage_error(proc, "gpu_kit: error", "'--out'")
