"""Lab 11: ZeRO stages 0-3 and FSDP inference under torchrun with 2 CPU processes (gloo): bytes per
rank against Lab 01, losses against DDP, sharded inference against Lab 08; the traffic counter;
bad input; broken promises; one rank of N traced in this process (the fake process group, fake
tensors) against the launched rank and against real tensors, and the page's claims at Llama-3-8B.

Two torchrun launches (training through every stage, inference in both placements) feed most
tests. Each is mostly process start-up, so they start together, in one module fixture. The broken
promises run one rank in this process.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.distributed as dist
from conftest import assert_clean_usage_error, assert_usage_error_in_process, load_lab, run_cli

from labkit.config import UsageError
from labkit import cli, fake, zoo
from labkit import dist as labdist
from labkit.ledger import Ledger
from labkit.timeline import CATEGORIES, Timeline
from labkit.traffic import Traffic

TRAIN = "lab-11-zero-fsdp/zero_fsdp.py"
TINY_TRAIN = {"device": "cpu", "width": 32, "heads": 2, "layers": 4, "seq_len": 16, "vocab": 64, "batch_size": 2,
              "steps": 3}
TINY_INFER = {"device": "cpu", "width": 32, "heads": 2, "denoiser_layers": 4, "latent_tokens": 16, "text_len": 8,
              "steps": 2}
# GPU sizes: large enough that the allocator's 512-byte blocks are a rounding error
CUDA_TRAIN = {"device": "cuda", "width": 256, "heads": 4, "layers": 4, "seq_len": 128, "vocab": 512, "batch_size": 4,
              "steps": 3}
MODEL_STATE = ("parameters", "gradients", "optimizer_state")


@pytest.fixture(scope="module")
def lab11():
    return load_lab(11)


@pytest.fixture(scope="module")
def inference():
    return load_lab(11, "fsdp_inference")


def summary_of(proc) -> dict:
    """Rank 0's one JSON object (the other ranks print nothing), from a finished launch."""
    stdout, stderr = proc.communicate(timeout=300)
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert proc.returncode == 0 and len(lines) == 1, stderr[-4000:]
    assert "Traceback" not in stderr and "Warning" not in stderr, stderr[-2000:]
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def launched(lab11, inference):
    running = {"train": labdist.torchrun(lab11, [*cli.argv(lab11.Config(**TINY_TRAIN, timelines=True)), "--json"]),
               "infer": labdist.torchrun(inference, [*cli.argv(inference.Config(**TINY_INFER, timelines=True)),
                                                     "--json"])}
    try:
        yield {name: summary_of(proc) for name, proc in running.items()}
    finally:
        for proc in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def trained(launched) -> dict:
    return launched["train"]


@pytest.fixture(scope="module")
def inferred(launched) -> dict:
    return launched["infer"]


def main(lab, argv: list[str]) -> None:
    """A lab's command line in this process, as its ``__main__`` runs it."""
    with labdist.one_voice() as voice:
        cli.main(lab.Config, voice.ranked(lab.run), lab.report, argv)


# --------------------------------------------------------------------------- training
def stage(result: dict, n: int) -> dict:
    return next(s for s in result["stages"] if s["stage"] == n)


def test_the_run_is_two_gloo_ranks_and_every_stage(trained):
    assert trained["world_size"] == 2 and trained["backend"] == "gloo" and trained["device"] == "cpu"
    assert [s["stage"] for s in trained["stages"]] == [0, 1, 2, 3]
    assert all(len(s["ranks"]) == 2 for s in trained["stages"])
    assert trained["provenance"]["lab"] == "lab-11-zero-fsdp" and trained["provenance"]["source_hash"]


def test_every_stage_trains_like_ddp(trained):
    ddp = stage(trained, 0)["losses"]
    assert len(ddp) == 3 and ddp[-1] < ddp[0]  # it learns
    assert stage(trained, 0)["max_loss_rel_diff_vs_ddp"] is None  # the reference
    for n in (1, 2, 3):
        s = stage(trained, n)
        assert s["max_loss_rel_diff_vs_ddp"] <= trained["loss_rtol"] == 1e-5, s["max_loss_rel_diff_vs_ddp"]
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
    """The model-state table's last column: zero but for ZeRO-1's optimizer state (whole tensors
    per rank, next test) and stage 2's parameters (FSDP keeps only shards at rest: Lab 01's stage 3)."""
    from zero_report import model_state_table

    p, t = trained["params"], trained["tensors"]
    rows = model_state_table(trained).rows
    assert len(rows) == 4 * 2 * 3
    nonzero = {(row[0].split(" ")[0], row[2]) for row in rows if row[5] != 0}
    assert nonzero == {("1", "optimizer state"), ("2", "parameters")}
    assert {row[3] for row in rows if row[0].startswith("2 ") and row[2] == "parameters"} == {4 * p // 2}
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
    p, steps = trained["params"], trained["config"]["steps"]
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


def test_the_timelines_are_rank_0s_last_step(trained):
    for s in trained["stages"]:
        tl = Timeline.from_dict(trained["timelines"][str(s["stage"])])
        assert {span.step for span in tl.spans} == {2}
        assert tl.peak() == s["ranks"][0]["peak_last_step"] and tl.peaks_by_phase() == s["ranks"][0]["peaks_by_phase_last_step"]


# --------------------------------------------------------------------------- inference
def test_sharded_inference_gives_the_unsharded_output(inferred):
    for placement, ranks in inferred["placements"].items():
        for r in ranks:
            assert r["max_abs_diff"] <= inferred["output_atol"] == 1e-5, (placement, r["max_abs_diff"])
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
        assert r["h2d_bytes_measured"] == 0  # CPU: nothing crosses a bus (derived instead, next test)
    for r in inferred["placements"]["sharded"]:
        assert r["peak_device"]["parameters"] == total // n and r["peak_host"] == 0


def test_device_bytes_per_gpu_against_lab08(inferred):
    from inference_report import largest_unit, per_gpu, units_table

    gpu = per_gpu(inferred)
    assert list(gpu) == ["sharded", "offload", "resident", "layerwise"]
    assert gpu["offload"]["device"] < gpu["resident"]["device"]
    total = sum(inferred["weight_bytes"][k] for k in ("text_encoder", "denoiser", "decoder"))
    assert gpu["sharded"]["device"] - gpu["offload"]["device"] == total // 2  # the shards are the whole difference
    assert gpu["offload"]["h2d_is"] == "derived" and gpu["offload"]["h2d"] == gpu["offload"]["received"]
    assert gpu["offload"]["h2d"] * 2 <= gpu["layerwise"]["h2d"]  # one shard each instead of every byte
    at_peak = inferred["placements"]["sharded+offload"][0]["peak_device"]["communication"]
    name, size = largest_unit(inferred)
    assert size <= at_peak <= 2 * size + inferred["weight_bytes"]["denoiser"] // 4
    assert units_table(inferred).rows == [[name, size, at_peak, at_peak / size]]


def test_the_inference_timelines_are_rank_0s_and_lab08s(inferred):
    offload = Timeline.from_dict(inferred["timelines"]["sharded+offload"])
    assert offload.peak() == inferred["placements"]["sharded+offload"][0]["peak_device"]
    layerwise = Timeline.from_dict(inferred["timelines"]["lab08 layerwise"])
    assert [s.name for s in layerwise.spans][0] == "encode" and max(layerwise.device_total()) > 0


def test_the_human_reports(trained, inferred, capsys):
    from inference_report import print_summary as print_inference
    from zero_report import print_summary as print_training

    print_training(trained)
    print_inference(inferred)
    out = capsys.readouterr().out
    assert "Lab 11 on cpu (gloo, 2 ranks)" in out and "against Lab 01's zero_model_state" in out
    assert "Lab 08 layerwise k=1 (1 device)" in out and "sharded+offload are derived" in out


def test_pinned_offload_needs_an_accelerator(inference):
    from inference_report import pinned_offload_support

    said = pinned_offload_support()
    if torch.cuda.is_available():
        assert said == "works"
    else:  # pinning needs an accelerator: the page's "What runs where"
        assert said.startswith("fails: `RuntimeError: ") and "accelerator" in said, said
    assert not dist.is_initialized()


# --------------------------------------------------------------------------- the traffic counter
@pytest.mark.usefixtures("one_rank")
def test_traffic_counts_a_collective_and_labels_its_buffer_for_the_ledger():
    dist.init_process_group("gloo")
    try:
        with Ledger("cpu") as ledger, Traffic() as traffic:
            bucket = torch.ones(1000)
            dist.all_reduce(bucket)
        with Traffic() as alone:  # no ledger watching: it only counts
            dist.all_reduce(torch.ones(10))
    finally:
        dist.destroy_process_group()
    assert traffic.summary() == {"collectives": {"allreduce_": {"calls": 1, "out_bytes": 4000, "in_bytes": 0,
                                                                 "largest_in_bytes": 0}}, "h2d_bytes": 0}
    assert ledger.timeline().at_end()["communication"] == 4000
    assert alone.summary()["collectives"]["allreduce_"]["out_bytes"] == 40


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("which", "fields", "fragment"), [
    ("train", {"width": 30, "heads": 4}, "not divisible"),
    ("train", {"snapshot": "s.pickle"}, "--snapshot needs a CUDA device"),
    ("infer", {"width": 30, "heads": 4}, "not divisible"),
    ("infer", {"denoiser_layers": 2, "prefetch_depth": 2}, "--prefetch-depth 2 is too deep for 2 denoiser blocks"),
])
def test_the_config_refuses_what_cannot_run(lab11, inference, which, fields, fragment):
    lab, tiny = (lab11, TINY_TRAIN) if which == "train" else (inference, TINY_INFER)
    with pytest.raises(UsageError, match=fragment):
        lab.Config(**{**tiny, **fields})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused_by_the_config(lab11, inference):
    for lab in (lab11, inference):
        with pytest.raises(UsageError, match="no CUDA GPU"):
            lab.Config(device="cuda")


def test_run_with_python_bad_input_is_refused_before_any_rank_starts(monkeypatch):
    for name in labdist.TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    proc = run_cli(TRAIN, "--device", "cpu", "--stage", "5")
    assert_clean_usage_error(proc, "--stage", "invalid choice")
    assert proc.stdout == ""


def test_inference_without_torchrun_in_process(inference, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert_usage_error_in_process(inference, ["--device", "cpu"], capsys, "launch with torchrun")


def test_an_unwritable_snapshot_folder_is_refused_before_the_process_group(lab11, capsys, monkeypatch):
    monkeypatch.setattr(cli, "pick_device", lambda name: torch.device("cuda"))  # as on a GPU machine
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")  # as under torchrun
    assert_usage_error_in_process(lab11, ["--snapshot", "/proc/lab11/s.pickle"], capsys,
                                  "--snapshot /proc/lab11/s.pickle: cannot write into /proc")
    assert not dist.is_initialized()


# --------------------------------------------------------------------------- broken promises
@pytest.mark.usefixtures("one_rank")
def test_training_beyond_its_tolerance_is_reported_then_one_line_and_exit_1(lab11, capsys, monkeypatch):
    """A real run of all four stages on one rank, with a tolerance no result can meet."""
    monkeypatch.setattr(lab11, "LOSS_RTOL", -1.0)
    with pytest.raises(SystemExit) as exc:
        main(lab11, [*cli.argv(lab11.Config(**{**TINY_TRAIN, "steps": 2})), "--json"])
    out, err = capsys.readouterr()
    assert exc.value.code == 1 and len(json.loads(out)["stages"]) == 4  # reported, then failed
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "check failed: stage 1 differs from DDP beyond -1e+00" in lines[0], lines


@pytest.mark.usefixtures("one_rank")
def test_inference_beyond_its_tolerance_is_reported_then_one_line_and_exit_1(inference, capsys, monkeypatch):
    monkeypatch.setattr(inference, "OUTPUT_ATOL", -1.0)
    with pytest.raises(SystemExit) as exc:
        main(inference, [*cli.argv(inference.Config(**TINY_INFER, placement="sharded")), "--json"])
    out, err = capsys.readouterr()
    assert exc.value.code == 1 and json.loads(out)["placements"]["sharded"]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "check failed: sharded: the output differs from the unsharded" in lines[0], lines


# --------------------------------------------------------------------------- GPU
def cuda_backend() -> str:
    """Two ranks: NCCL when each has its own GPU, gloo when they share one (NCCL does not allow it)."""
    return "nccl" if torch.cuda.device_count() >= 2 else "gloo"


@pytest.mark.cuda
def test_cpu_offload_with_pinned_memory_on_a_gpu(inference):
    """CPUOffloadPolicy(pin_memory=True) fails on a CPU-only torch; on a GPU the shard copies are measured."""
    config = inference.Config(**{**TINY_INFER, "device": "cuda"}, placement="sharded+offload")
    data = labdist.launch(inference, {"cuda": config}, timeout=300)["cuda"]
    assert data["backend"] == cuda_backend() and data["world_size"] == 2
    for r in data["placements"]["sharded+offload"]:
        assert r["max_abs_diff"] <= data["output_atol"]
        assert r["h2d_bytes_measured"] == r["sent_bytes"] > 0  # every shard crossed to the device once per gather
        assert r["peak_device"]["parameters"] == 0 and r["peak_host"] >= r["shard_bytes"]
        assert r["cuda"]["max_memory_allocated"] > 0


@pytest.fixture(scope="module")
def trained_on_cuda(lab11) -> dict:
    return labdist.launch(lab11, {"cuda": lab11.Config(**CUDA_TRAIN)}, timeout=400)["cuda"]


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
def test_fsdp_shards_on_cuda_match_lab01_within_block_rounding(lab11):
    config = lab11.Config(**{**TINY_TRAIN, "device": "cuda"}, stage="3")
    data = labdist.launch(lab11, {"cuda": config}, timeout=300)["cuda"]
    s = data["stages"][0]
    for r in s["ranks"]:
        for cat in ("parameters", "gradients"):
            assert s["lab01"][cat] <= r["at_end"][cat] <= s["lab01"][cat] + 512 * data["tensors"]


# --------------------------------------------------------------------------- one rank of N, in this process
GIB = 2**30


def traced_exactly(lab11, monkeypatch, **fields) -> dict:
    """A --world-size run's summary, with --fake counting exact bytes (block=None), as a CPU run does:
    the 512-byte rounding a --fake run adds is labkit.fake's own, tested there."""
    monkeypatch.setattr(fake, "tensors", functools.partial(fake.tensors, block=None))
    return lab11.run(lab11.Config(**fields)).summary()


def test_a_traced_rank_is_rank_0_of_the_launched_job(trained, lab11, monkeypatch):
    """The two-process gloo run's rank 0, and the same job's rank 0 traced in this process under the
    fake process group on fake tensors: every stage ends its run with the same bytes in every
    category, and its last step holds the same parameters and optimizer state at the peak of every
    phase. The collectives that moved data there move none here; the buffers they need are the same,
    but not always for as long: gloo's worker thread finishes a collective, and frees what it held,
    on its own schedule, where the fake group finishes at once. So a peak of the launched run may
    hold one collective buffer more (at most the largest the run sent: stage 2 was seen with one
    block's all-gather buffer more) and its gradients a little earlier or later. (The trace names
    AdamW's for-loop, what PyTorch picks on CPU tensors, as the launched run did.)"""
    trace = traced_exactly(lab11, monkeypatch, **TINY_TRAIN, world_size=2, fake=True, adamw="for-loop")
    assert trace["traced"].startswith("traced on fake tensors") and trace["world_size"] == 2
    assert [s["stage"] for s in trace["stages"]] == [0, 1, 2, 3]
    for launched_stage, mine in zip(trained["stages"], trace["stages"]):
        rank0 = launched_stage["ranks"][0]
        assert mine["at_end"] == rank0["at_end"], mine["stage"]
        assert mine["lab01"] == {c: launched_stage["lab01"][c] for c in MODEL_STATE}
        slack = max(v["largest_in_bytes"] for v in rank0["traffic"]["collectives"].values()) + 1024
        pairs = [(rank0["peak_last_step"], mine["peak_last_step"]),
                 *((row, mine["peaks_by_phase_last_step"][phase])
                   for phase, row in rank0["peaks_by_phase_last_step"].items())]
        for a, b in pairs:
            assert (a["parameters"], a["optimizer_state"]) == (b["parameters"], b["optimizer_state"]), mine["stage"]
            assert abs(sum(a[c] for c in CATEGORIES) - sum(b[c] for c in CATEGORIES)) <= slack, (mine["stage"], a, b)
        ops = rank0["traffic"]["collectives"]
        op = "allreduce_" if mine["stage"] <= 1 else "_allgather_base_"
        assert mine["collectives_per_step"][op]["out_bytes"] == ops[op]["out_bytes"] // TINY_TRAIN["steps"]


def test_fake_and_real_tensors_trace_the_same_rank(lab11, monkeypatch):
    """small-llama, rank 0 of 4, every stage, under the fake process group: on real tensors and on
    fake ones, the same bytes at every row of the last step's timeline, hence every peak; the split
    of the communication bytes at the peak is the same too."""
    size = dict(model="small-llama", world_size=4, seq_len=32, batch_size=2, steps=2, adamw="foreach", timelines=True)
    real = lab11.run(lab11.Config(**size)).summary()
    trace = traced_exactly(lab11, monkeypatch, **size, fake=True)
    assert real["traced"] is None and trace["traced"] and real["params"] == trace["params"] == zoo.get(
        "small-llama").param_count()
    for a, b in zip(real["stages"], trace["stages"]):
        assert a == b, a["stage"]
    for stage, tl in real["timelines"].items():
        assert tl["device"] == trace["timelines"][stage]["device"] and tl["spans"] == trace["timelines"][stage]["spans"]


def test_the_communication_split_adds_up_to_the_category(lab11):
    """At each stage's peak the gathered weights and the buffers are the ``communication`` bytes;
    DDP's are all buffers (its buckets), FSDP2 with reshard_after_forward=False holds every weight
    gathered (4 B x P) and then no buffer."""
    trace = lab11.run(lab11.Config(**TINY_TRAIN, world_size=2, fake=True)).summary()
    p = trace["params"]
    for s in trace["stages"]:
        split = s["communication_at_peak"]
        assert sum(split.values()) == s["peak_last_step"]["communication"] > 0, s["stage"]
        if s["stage"] <= 1:
            assert split["gathered_weights"] == 0
    stage2 = trace["stages"][2]["communication_at_peak"]
    assert 4 * p <= stage2["gathered_weights"] < 4 * p + 512 * trace["tensors"]


def test_at_64_ranks_zero3_shards_the_state_but_not_the_activations(lab11):
    """The page's stage-3 claims, traced at a real model half the depth of Llama-3-8B (Llama-3.2-1B,
    the same code, 4 s instead of 8), 64 ranks, 4,096 tokens per rank, FSDP2
    reshard_after_forward=True: the model state at rest is Lab 01's 16 B x P / 64 (each shard rounded
    to 512 B); at the peak of the step, at the turn from forward to backward, the fp32 activations of
    one sequence are over 25 times that, the gathered weights are the root unit (what the blocks do
    not hold: the embedding, tied to the head here, and the final norm; 4 B each) and the buffers
    one block's all-gather output."""
    spec = zoo.get("llama-3.2-1b")
    s = lab11.run(lab11.Config(model="llama-3.2-1b", fake=True, world_size=64, seq_len=4096, batch_size=1, steps=2,
                               stage="3")).summary()["stages"][0]
    at_rest, derived = s["model_state_at_rest"], s["lab01_model_state"]
    assert at_rest == sum(s["at_end"][c] for c in MODEL_STATE) and derived == sum(s["lab01"].values())
    assert derived <= at_rest < derived + 3 * 512 * s["tensors"]
    with torch.device("meta"):
        block = sum(p.numel() for p in spec.build().blocks[0].parameters())
    root = spec.param_count() - spec.layers * block
    assert root == spec.vocab * spec.width + spec.width  # tied: one embedding for the head too
    assert s["communication_at_peak"] == {"gathered_weights": 4 * root, "buffers": 4 * block}
    assert s["peak_last_step"]["activations"] > 25 * at_rest and s["peak_phase"] == "backward"


def test_at_llama_3_8b_on_64_ranks_zero1_gives_rank_0_the_embedding_state(lab11):
    """ZeroRedundancyOptimizer hands out whole tensors, largest first, each to the rank with the
    fewest elements so far: rank 0 gets the token embedding (128,256 x 4,096), whose AdamW moments
    alone are 4 times the 1/64 share Lab 01's formula gives it."""
    spec = zoo.get("llama-3-8b")
    s = lab11.run(lab11.Config(model="llama-3-8b", fake=True, world_size=64, seq_len=256, batch_size=1, steps=2,
                               stage="1")).summary()["stages"][0]
    embedding_moments = 8 * spec.vocab * spec.width
    assert s["at_end"]["optimizer_state"] >= embedding_moments > 4 * s["lab01"]["optimizer_state"]
    assert s["at_end"]["parameters"] == s["at_end"]["gradients"] == s["at_end"]["communication"] == 4 * spec.param_count()


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"fake": True}, "--fake traces one rank in this process: give --world-size N"),
    ({"world_size": 8, "device": "cuda"}, "--world-size runs one rank in this process on the CPU"),
])
def test_a_traced_rank_needs_a_world_size_on_the_cpu(lab11, fields, fragment):
    with pytest.raises(UsageError, match=fragment):
        lab11.Config(**fields)


def test_a_traced_rank_from_the_command_line():
    proc = run_cli(TRAIN, "--model", "small-llama", "--fake", "--world-size", "8", "--stage", "3", "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 of 8 in one process (fake process group): small-llama" in proc.stdout
    assert "traced on fake tensors" in proc.stdout and "peak − Lab 01" in proc.stdout
