"""Lab 11: ZeRO stages 0-3 and FSDP inference, launched as CI does: torchrun, 2 CPU processes, gloo.

Two torchrun launches (one training run through every stage, one inference run) feed most tests;
each launch costs a few seconds of process start-up, so they are module fixtures. The broken-
tolerance tests run one rank in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import CODE, ROOT, assert_clean_usage_error, assert_usage_error_in_process, load_lab, run_cli

from labkit import run_lab
from labkit.dist import ranked

TRAIN = "lab-11-zero-fsdp/zero_fsdp.py"
INFER = "lab-11-zero-fsdp/fsdp_inference.py"
TINY_TRAIN = ["--width", "32", "--heads", "2", "--layers", "4", "--seq-len", "16", "--vocab", "64",
              "--batch-size", "2", "--steps", "3"]
TINY_INFER = ["--width", "32", "--heads", "2", "--denoiser-layers", "4", "--latent-tokens", "16", "--text-len", "8",
              "--steps", "2"]
# GPU sizes: large enough that the allocator's 512-byte blocks are a rounding error
CUDA_TRAIN = ["--width", "256", "--heads", "4", "--layers", "4", "--seq-len", "128", "--vocab", "512",
              "--batch-size", "4", "--steps", "3"]
MODEL_STATE = ("parameters", "gradients", "optimizer_state")


def torchrun_command(script: str, *args: str, nproc: int = 2) -> tuple[list[str], dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
            str(CODE / script), *args], env


def torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 180) -> subprocess.CompletedProcess:
    cmd, env = torchrun_command(script, *args, nproc=nproc)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def one_json_object(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout[-2000:]  # rank 0 prints one object; the other ranks print nothing
    assert "Traceback" not in proc.stderr
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def launched():
    """Both CPU runs start together (each spends most of its few seconds starting processes)."""
    runs = {}
    for name, script, args in (("train", TRAIN, TINY_TRAIN), ("infer", INFER, TINY_INFER)):
        cmd, env = torchrun_command(script, "--device", "cpu", "--json", *args)
        runs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    yield runs
    for proc in runs.values():
        proc.kill() if proc.poll() is None else None


def finished(proc: subprocess.Popen, timeout: int = 180) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def trained(launched) -> dict:
    return one_json_object(finished(launched["train"]))


@pytest.fixture(scope="module")
def inferred(launched) -> dict:
    return one_json_object(finished(launched["infer"]))


@pytest.fixture(scope="module")
def lab11():
    return load_lab(TRAIN)


@pytest.fixture(scope="module")
def lab11_inference():
    return load_lab(INFER)


# --------------------------------------------------------------------------- training


def stage(result: dict, n: int) -> dict:
    return next(s for s in result["stages"] if s["stage"] == n)


def test_the_run_is_two_gloo_ranks_and_every_stage(trained):
    assert trained["world_size"] == 2 and trained["backend"] == "gloo" and trained["rank"] == 0
    assert [s["stage"] for s in trained["stages"]] == [0, 1, 2, 3]
    assert all(len(s["ranks"]) == 2 for s in trained["stages"])
    assert trained["provenance"]["device_type"] == "cpu" and trained["provenance"]["source_hash"]


def test_every_stage_trains_like_ddp(trained):
    ddp = stage(trained, 0)["losses"]
    assert len(ddp) == 3 and ddp[-1] < ddp[0]  # it learns
    for n in (1, 2, 3):
        s = stage(trained, n)
        assert s["max_loss_rel_diff_vs_ddp"] <= trained["loss_rtol"], s["max_loss_rel_diff_vs_ddp"]
        assert s["max_param_abs_diff_vs_ddp"] <= trained["loss_rtol"], s["max_param_abs_diff_vs_ddp"]
        assert s["ranks"][0]["losses"] != s["ranks"][1]["losses"]  # every rank trains on its own micro-batch


def assert_model_state_falls_stage_by_stage(result: dict) -> None:
    for rank in (0, 1):
        at_end = [stage(result, n)["ranks"][rank]["at_end"] for n in range(4)]
        for cat in ("parameters", "gradients"):
            assert all(a[cat] >= b[cat] for a, b in zip(at_end, at_end[1:])), (cat, [a[cat] for a in at_end])
        adam = [a["optimizer_state"] for a in at_end]
        assert max(adam[1:]) < 0.6 * adam[0] and adam[2] == adam[3]  # stage 1 on: about 1/N each
        assert at_end[2]["gradients"] < at_end[1]["gradients"]  # stage 2 shards gradients
        assert at_end[2]["parameters"] < at_end[1]["parameters"]  # FSDP keeps only shards at rest


def test_model_state_per_rank_falls_stage_by_stage(trained):
    assert_model_state_falls_stage_by_stage(trained)


def test_ddp_and_fsdp_match_lab01_to_the_byte(trained):
    p, t = trained["params"], trained["tensors"]
    for n in (0, 2, 3):
        s = stage(trained, n)
        for r in s["ranks"]:
            for cat in MODEL_STATE:
                want = s["lab01"][cat] if (n, cat) != (2, "parameters") else 4 * p // 2
                assert r["at_end"][cat] == want, (n, cat, r["at_end"][cat], want)
    assert stage(trained, 0)["lab01"]["optimizer_state"] == 8 * p + 4 * t
    assert stage(trained, 2)["lab01"]["parameters"] == 4 * p  # Lab 01's stage 2 keeps whole parameters


def test_zero1_partitions_whole_tensors(trained):
    s0, s1 = stage(trained, 0), stage(trained, 1)
    shares = [r["at_end"]["optimizer_state"] for r in s1["ranks"]]
    assert sum(shares) == s0["ranks"][0]["at_end"]["optimizer_state"]  # every tensor's state on exactly one rank
    w = trained["config"]["width"]
    biggest = 12 * w * w + 4  # 2 moments x 4 B of the largest tensor (4w x w) and its step counter
    assert all(abs(share - s1["lab01"]["optimizer_state"]) < biggest for share in shares)


def test_communication_buffers_and_traffic(trained):
    p = trained["params"]
    steps = trained["config"]["steps"]
    peak = {n: stage(trained, n)["ranks"][0]["peak_last_step"]["communication"] for n in range(4)}
    assert peak[0] == peak[1] == 4 * p  # DDP's gradient buckets: one more copy of the gradients
    assert peak[2] >= 4 * p  # every gathered weight held from forward to the end of backward
    assert 0 < peak[3] < peak[2]  # gathered block by block
    for n in (2, 3):
        assert stage(trained, n)["ranks"][0]["at_end"]["communication"] == 0  # gathered weights freed
    ops = {n: stage(trained, n)["ranks"][0]["traffic"]["collectives"] for n in range(4)}
    assert ops[0]["allreduce_"]["out_bytes"] == 4 * p * steps
    gathered = {n: ops[n]["_allgather_base_"]["out_bytes"] for n in (2, 3)}
    assert gathered[2] == 4 * p * steps and gathered[3] == 2 * gathered[2]  # stage 3 gathers again for backward
    assert ops[2]["_reduce_scatter_base_"] == ops[3]["_reduce_scatter_base_"]


def test_peak_of_a_step_falls_as_the_stage_rises(trained):
    totals = [stage(trained, n)["ranks"][0]["peak_last_step"]["total"] for n in range(4)]
    assert totals == sorted(totals, reverse=True) and totals[3] < totals[0], totals


def test_human_reports(trained, inferred, lab11, lab11_inference, capsys):
    lab11.print_report(trained)
    lab11_inference.print_report(inferred)
    out = capsys.readouterr().out
    assert "Lab 11 on cpu (gloo, 2 ranks)" in out and "(each cell: measured / Lab 01)" in out
    assert "Lab 08 layerwise (k=1)" in out and "H2D of sharded+offload is derived" in out


# --------------------------------------------------------------------------- inference


def test_sharded_inference_gives_the_unsharded_output(inferred):
    for placement, ranks in inferred["placements"].items():
        for r in ranks:
            assert r["max_abs_diff"] <= inferred["output_atol"], (placement, r["max_abs_diff"])
    assert inferred["lab08"]["layerwise"]["max_abs_diff"] == 0.0


def test_offloaded_shards_and_bytes_sent(inferred):
    w, n, steps = inferred["weight_bytes"], inferred["world_size"], inferred["config"]["steps"]
    total = w["text_encoder"] + w["denoiser"] + w["decoder"]
    per_image = w["text_encoder"] + steps * w["denoiser"] + w["decoder"]  # each unit gathered each time it runs
    for r in inferred["placements"]["sharded+offload"]:
        assert r["shard_bytes"] == total // n  # even dimensions: no padding
        assert r["peak_host"] == r["shard_bytes"]  # the shards live on the host ...
        assert r["peak_device"]["parameters"] == 0 and r["peak_device"]["host_copies"] == 0  # ... not the device
        assert r["sent_bytes"] == per_image // n and r["gathered_bytes"] == per_image
        assert r["h2d_bytes_measured"] == 0  # CPU: nothing crosses a bus (derived on the page instead)
    for r in inferred["placements"]["sharded"]:
        assert r["peak_device"]["parameters"] == total // n and r["peak_host"] == 0


def test_device_bytes_per_rank_against_lab08(inferred):
    offload = inferred["placements"]["sharded+offload"][0]["peak_device"]
    sharded = inferred["placements"]["sharded"][0]["peak_device"]["total"]
    resident = inferred["lab08"]["none"]["peak_device_bytes"]
    layerwise = inferred["lab08"]["layerwise"]
    total = sum(inferred["weight_bytes"][k] for k in ("text_encoder", "denoiser", "decoder"))
    assert offload["total"] < resident
    assert sharded - offload["total"] == total // inferred["world_size"]  # the shards are the whole difference
    largest_unit = max(inferred["weight_bytes"][k] for k in ("text_encoder", "decoder", "denoiser_block"))
    assert largest_unit <= offload["communication"] <= 2 * largest_unit + inferred["weight_bytes"]["denoiser"] // 4
    sent = inferred["placements"]["sharded+offload"][0]["sent_bytes"]
    assert sent * inferred["world_size"] <= layerwise["h2d_bytes"]  # one shard each instead of every byte


# --------------------------------------------------------------------------- command line


def test_without_torchrun_it_says_how_to_launch():
    proc = run_cli(TRAIN, "--device", "cpu")
    assert_clean_usage_error(proc, "RANK and WORLD_SIZE are not set", "torchrun --nproc_per_node=2")
    assert proc.stdout == ""


def test_without_torchrun_in_process(lab11_inference, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert_usage_error_in_process(lab11_inference.main, ["--device", "cpu"], capsys, "RANK and WORLD_SIZE")


@pytest.mark.parametrize(("args", "fragment"), [
    (["--stage", "4"], "--stage"),
    (["--steps", "0"], "--steps"),
    (["--width", "30", "--heads", "4"], "not divisible"),
    (["--lr", "-1"], "--lr"),
    (["--device", "tpu"], "--device"),
    (["--snapshot", "x.pickle", "--device", "cpu"], "needs a CUDA device"),
])
def test_bad_training_arguments(lab11, capsys, args, fragment):
    assert_usage_error_in_process(lab11.main, args, capsys, fragment)


@pytest.mark.parametrize(("args", "fragment"), [
    (["--placement", "replicated"], "--placement"),
    (["--steps", "-1"], "--steps"),
    (["--width", "30", "--heads", "4"], "not divisible"),
    (["--prefetch-depth", "-2"], "--prefetch-depth"),
])
def test_bad_inference_arguments(lab11_inference, capsys, args, fragment):
    assert_usage_error_in_process(lab11_inference.main, args, capsys, fragment)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_gpu_is_one_line(lab11, capsys):
    assert_usage_error_in_process(lab11.main, ["--device", "cuda"], capsys, "no CUDA GPU")


def test_unwritable_snapshot_folder_is_refused_before_training(lab11, capsys, monkeypatch):
    monkeypatch.setattr(lab11, "pick_device", lambda name: torch.device("cuda"))  # as on a GPU machine
    assert_usage_error_in_process(lab11.main, ["--snapshot", "/proc/lab11/s.pickle"], capsys,
                                  "--snapshot /proc/lab11: cannot write there")


# --------------------------------------------------------------------------- broken tolerances


@pytest.mark.usefixtures("one_rank")
def test_training_beyond_its_tolerance_is_one_line_and_exit_1(lab11, capsys, monkeypatch):
    """A real run of all four stages on one rank, with a tolerance no result can meet."""
    monkeypatch.setattr(lab11, "LOSS_RTOL", -1.0)
    with pytest.raises(SystemExit) as exc:
        run_lab(ranked(lab11.main), ["--device", "cpu", "--json", *TINY_TRAIN, "--steps", "2"])
    out, err = capsys.readouterr()
    assert exc.value.code == 1 and len(json.loads(out)["stages"]) == 4  # reported, then failed
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "check failed: stage 1 differs from DDP beyond -1e+00" in lines[0], lines


@pytest.mark.usefixtures("one_rank")
def test_inference_beyond_its_tolerance_is_one_line_and_exit_1(lab11_inference, capsys, monkeypatch):
    monkeypatch.setattr(lab11_inference, "OUTPUT_ATOL", -1.0)
    with pytest.raises(SystemExit) as exc:
        run_lab(ranked(lab11_inference.main), ["--device", "cpu", "--json", "--placement", "sharded", *TINY_INFER])
    out, err = capsys.readouterr()
    assert exc.value.code == 1 and json.loads(out)["placements"]["sharded"]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "check failed: sharded: the output differs from the unsharded" in lines[0], lines


# --------------------------------------------------------------------------- GPU


def cuda_backend() -> str:
    """Two ranks: NCCL when each has its own GPU, gloo when they share one (NCCL does not allow it)."""
    return "nccl" if torch.cuda.device_count() >= 2 else "gloo"


@pytest.mark.cuda
def test_cpu_offload_with_pinned_memory_on_a_gpu():
    """CPUOffloadPolicy(pin_memory=True) fails on a CPU-only torch; on a GPU the shard copies are measured."""
    data = one_json_object(torchrun(INFER, "--device", "cuda", "--json", "--placement", "sharded+offload",
                                    *TINY_INFER))
    assert data["backend"] == cuda_backend() and data["world_size"] == 2
    for r in data["placements"]["sharded+offload"]:
        assert r["max_abs_diff"] <= data["output_atol"]
        assert r["h2d_bytes_measured"] == r["sent_bytes"] > 0  # every shard crossed to the device once per gather
        assert r["peak_device"]["parameters"] == 0 and r["peak_host"] >= r["shard_bytes"]
        assert r["cuda"]["max_memory_allocated"] > 0


@pytest.fixture(scope="module")
def trained_on_cuda() -> dict:
    return one_json_object(torchrun(TRAIN, "--device", "cuda", "--json", *CUDA_TRAIN, timeout=400))


@pytest.mark.cuda
def test_training_stages_on_cuda_two_ranks(trained_on_cuda):
    data = trained_on_cuda
    assert data["backend"] == cuda_backend() and data["world_size"] == 2
    for s in data["stages"][1:]:
        assert s["max_loss_rel_diff_vs_ddp"] <= data["loss_rtol"], s["stage"]
    assert_model_state_falls_stage_by_stage(data)  # bytes fall as the stage rises, on the GPU too


@pytest.mark.cuda
def test_ledger_and_allocator_agree_within_5_percent_over_the_last_step(trained_on_cuda):
    """Same window (the last step), bytes the allocator held unseen before it set aside; with gloo,
    the copy of each reduce-scatter input gloo makes inside the backend is allowed for."""
    for s in trained_on_cuda["stages"]:
        for r in s["ranks"]:
            c = r["cuda"]
            assert c["ledger_over_allocator"] <= 1.05, (s["stage"], c)
            assert c["ledger_and_hidden_over_allocator"] >= 0.95, (s["stage"], c)


@pytest.mark.cuda
def test_fsdp_shards_on_cuda_match_lab01_within_block_rounding():
    data = one_json_object(torchrun(TRAIN, "--device", "cuda", "--json", "--stage", "3", *TINY_TRAIN))
    s = data["stages"][0]
    for r in s["ranks"]:
        for cat in ("parameters", "gradients"):
            assert s["lab01"][cat] <= r["at_end"][cat] <= s["lab01"][cat] + 512 * data["tensors"]
