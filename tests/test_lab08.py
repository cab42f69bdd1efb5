"""Lab 08: offload engines against the all-resident pipeline: equal outputs, bounded residency,
peak ordering, clean removal, exception safety, exact transfer accounting, bad input."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import ROOT, assert_clean_usage_error, assert_usage_error_in_process, load_lab, run_cli

from labkit import Ledger, run_lab
from labkit.diffusion import DiffusionConfig, ToyDiffusionPipeline

SCRIPT = "lab-08-offload-memory-saving/offload.py"
SMALL = ["--device", "cpu", "--width", "32", "--heads", "2", "--denoiser-layers", "5", "--text-layers", "1",
         "--decoder-layers", "1", "--latent-tokens", "16", "--text-len", "8", "--steps", "2", "--repeats", "1"]


@pytest.fixture(scope="module")
def lab08():
    return load_lab(SCRIPT)


@pytest.fixture(scope="module")
def engines(lab08):
    import offload_engines  # importable once the lab folder is on sys.path (load_lab does that)

    return offload_engines


@pytest.fixture(scope="module")
def all_modes(lab08):
    return {r.mode: r for r in lab08.run_all(lab08.parse_args([*SMALL, "--mode", "all"]))}


def small_pipeline(seed=0):
    cfg = DiffusionConfig(width=32, heads=2, denoiser_layers=5, text_layers=1, decoder_layers=1,
                          latent_tokens=16, text_len=8, steps=2)
    return ToyDiffusionPipeline(cfg, seed=seed)


def snapshot(model: torch.nn.Module) -> dict:
    return {
        "values": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "params": [(id(p), p.device, p.dtype, p.requires_grad, tuple(p.shape)) for p in model.parameters()],
        "hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()),
        "contiguous": all(p.is_contiguous() for p in model.parameters()),
    }


def assert_same(before: dict, model: torch.nn.Module) -> None:
    after = snapshot(model)
    assert after["params"] == before["params"] and after["hooks"] == before["hooks"] == 0
    assert after["contiguous"]
    for k, v in before["values"].items():
        assert torch.equal(v, after["values"][k]), k


def test_every_mode_matches_the_resident_output_exactly(all_modes):
    assert set(all_modes) == {"none", "model", "sequential", "layerwise"}
    for run in all_modes.values():
        assert run.summary["max_abs_diff"] == 0.0, run.mode
        assert torch.equal(run.output, all_modes["none"].output)


def test_peak_device_bytes_order(all_modes):
    peak = {m: r.summary["peak_device_bytes"] for m, r in all_modes.items()}
    assert peak["sequential"] <= peak["layerwise"] < peak["model"] < peak["none"], peak


def test_nothing_is_ever_copied_back(all_modes):
    assert all(r.summary["d2h_bytes"] == 0 for r in all_modes.values())


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_layerwise_keeps_at_most_k_plus_1_blocks_and_the_ledger_agrees(lab08, engines, k):
    # encoder and decoder stay resident, so every change in device bytes while denoising is blocks
    flags = ["--mode", "layerwise", "--prefetch-depth", str(k), "--encoder-offload", "off", "--decoder-offload", "off"]
    run = lab08.run_all(lab08.parse_args([*SMALL, *flags]))[0]
    n = run.summary["denoiser_blocks"]
    expected = min(k, n - 1) + 1
    assert run.summary["max_resident_blocks"] == expected
    pipe = small_pipeline()
    block = engines.HostMaster(list(pipe.denoiser.blocks[0].parameters()), pinned=False).nbytes
    blocks_ids = {id(p) for p in pipe.denoiser.blocks.parameters()}
    shell = engines.HostMaster([p for p in pipe.denoiser.parameters() if id(p) not in blocks_ids], pinned=False).nbytes
    resident = sum(p.numel() * p.element_size() for m in (pipe.text_encoder, pipe.decoder) for p in m.parameters())
    tl = run.ledger.timeline()
    during = [tl.device["parameters"][i] for i in range(len(tl)) if tl.phase[i] == "denoise"]
    assert max(during) == resident + shell + expected * block  # the ledger's bytes: k+1 blocks, never more
    # exact transfer accounting for one pipeline run: every block once per step, plus the k blocks
    # prefetched for a step that never comes, plus the denoiser's weights outside the blocks
    assert run.summary["h2d_bytes"] == shell + (pipe.cfg.steps * n + expected - 1) * block


@pytest.mark.parametrize("mode", ["none", "model", "sequential", "layerwise"])
def test_removing_the_handles_leaves_the_model_exactly_as_it_was(lab08, mode):
    args = lab08.parse_args([*SMALL, "--mode", mode])
    pipe = small_pipeline()
    before = snapshot(pipe)
    device = torch.device("cpu")
    prompt, noise = pipe.inputs(0, device)
    ledger = Ledger(device)
    from labkit.schedule import Recorder

    with torch.no_grad():
        handles = lab08.install(mode, pipe, device, args, ledger.category, Recorder(device))
        out, _ = lab08.run_pipeline(pipe, handles, prompt, noise, ledger, Recorder(device))
        for h in reversed(handles):
            h.remove()
    assert_same(before, pipe)
    with torch.no_grad():
        assert torch.equal(pipe(prompt, noise), out)  # and it still runs, with no hooks at all


def test_handles_are_context_managers(engines):
    pipe = small_pipeline()
    before = snapshot(pipe)
    prompt, noise = pipe.inputs(0, "cpu")
    with torch.no_grad():
        expected = pipe(prompt, noise)
        with engines.LayerwiseOffload(pipe.denoiser.blocks, "cpu", prefetch_depth=2, pinned=False) as h:
            assert all(p.numel() == 0 for p in pipe.denoiser.blocks.parameters())  # released at install
            assert torch.equal(pipe(prompt, noise), expected)
            assert h.max_resident == 3
    assert_same(before, pipe)


@pytest.mark.parametrize("kind", ["layerwise", "sequential", "model"])
def test_an_exception_inside_a_block_leaves_the_model_consistent(engines, kind):
    pipe = small_pipeline()
    before = snapshot(pipe)
    prompt, noise = pipe.inputs(0, "cpu")
    with torch.no_grad():
        expected = pipe(prompt, noise)
    if kind == "layerwise":
        handle = engines.LayerwiseOffload(pipe.denoiser.blocks, "cpu", prefetch_depth=1, pinned=False)
    elif kind == "sequential":
        handle = engines.SequentialOffload(pipe, "cpu", pinned=False)
    else:
        handle = engines.ModelOffload(pipe.components(), "cpu", pinned=False)
    bad = pipe.denoiser.blocks[3]
    bad.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom in block 3"))
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom in block 3"):
        pipe(prompt, noise)
    del bad.forward  # the block works again
    if kind == "layerwise":
        assert handle.resident() <= 2  # block 3 was evicted by its always-called post hook
        assert all(p.numel() == 0 for p in bad.parameters())
    with torch.no_grad():
        assert torch.equal(pipe(prompt, noise), expected)  # the same handle still works
    handle.remove()
    assert_same(before, pipe)


def test_layerwise_refuses_a_negative_depth(engines):
    with pytest.raises(ValueError, match="0 or more"):
        engines.LayerwiseOffload(small_pipeline().denoiser.blocks, "cpu", prefetch_depth=-1)


def test_host_masters_use_one_aligned_flat_buffer_per_unit(engines):
    block = small_pipeline().denoiser.blocks[0]
    master = engines.HostMaster(list(block.parameters()), pinned=False)
    assert master.flat.dtype == torch.uint8 and master.flat.dim() == 1
    assert all(o % engines.ALIGN == 0 for o, *_ in master.layout)
    raw = sum(p.numel() * p.element_size() for p in block.parameters())
    assert raw <= master.nbytes < raw + engines.ALIGN * len(master.layout)
    for p, view in zip(block.parameters(), master.views(master.flat)):
        assert torch.equal(p, view)


def test_json_reports_every_required_field():
    proc = run_cli(SCRIPT, *SMALL, "--mode", "all", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    modes = {m["mode"]: m for m in data["modes"]}
    assert set(modes) == {"none", "model", "sequential", "layerwise"}
    for m in modes.values():
        for key in ("mode", "peak_device_bytes", "max_resident_blocks", "h2d_bytes", "d2h_bytes", "step_ms",
                    "max_abs_diff", "provenance", "max_memory_allocated"):
            assert key in m, key
        assert m["provenance"]["source_hash"]
    assert modes["layerwise"]["prefetch_depth"] == 1
    assert proc.stderr == ""


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--prefetch-depth", "-1"], "--prefetch-depth"),
        (["--mode", "fast"], "--mode"),
        (["--width", "30", "--heads", "4"], "not divisible"),
        (["--steps", "0"], "--steps"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(lab08, capsys, args, fragment):
    assert_usage_error_in_process(lab08.main, [*SMALL, *args], capsys, fragment)


def test_bad_depth_from_the_command_line():
    assert_clean_usage_error(run_cli(SCRIPT, "--prefetch-depth", "-2"), "--prefetch-depth")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_pinned_memory_without_cuda_is_refused(lab08, capsys):
    with pytest.raises(SystemExit) as exc:
        run_lab(lab08.main, [*SMALL, "--pinned", "on"], prog="offload.py")
    assert exc.value.code == 2 and "--pinned on needs a CUDA driver" in capsys.readouterr().err


def test_offload_plan_is_generated_from_a_run(tmp_path):
    """The committed plan equals a fresh run's, except the timing columns and the provenance line."""
    fresh = tmp_path / "plan.md"
    proc = run_cli("lab-08-offload-memory-saving/make_plan.py", "--device", "cpu", "--repeats", "1",
                   "--out", str(fresh), timeout=600)
    assert proc.returncode == 0, proc.stderr
    committed = (ROOT / "code" / "lab-08-offload-memory-saving" / "offload_plan.md").read_text()

    def stable(text: str) -> list[str]:
        out = []
        for line in text.splitlines():
            if line.startswith("Pipeline:"):
                line = line.split("Measured:")[0]
            if line.startswith("|") and " ms |" in line:
                cells = line.split("|")
                del cells[5]  # the transfer time column
                line = "|".join(cells)
            out.append(re.sub(r"\s+", " ", line))
        return out

    assert stable(fresh.read_text()) == stable(committed)


def test_make_plan_refuses_a_mode(capsys):
    make_plan = load_lab("lab-08-offload-memory-saving/make_plan.py")
    with pytest.raises(SystemExit) as exc:
        run_lab(make_plan.main, ["--mode", "model"], prog="make_plan.py")
    assert exc.value.code == 2 and "always runs every mode" in capsys.readouterr().err


# ------------------------------------------------------------------ GPU only
GPU_SIZE = ["--device", "cuda", "--width", "1024", "--heads", "16", "--denoiser-layers", "8",
            "--latent-tokens", "2048", "--steps", "2", "--repeats", "2"]


@pytest.mark.cuda
def test_cuda_outputs_match_and_layerwise_overlaps_copy_with_compute(lab08):
    runs = {r.mode: r for r in lab08.run_all(lab08.parse_args([*GPU_SIZE, "--mode", "all"]))}
    for r in runs.values():
        assert r.summary["max_abs_diff"] <= 1e-5, (r.mode, r.summary["max_abs_diff"])
        assert r.summary["max_memory_allocated"] > 0
    layer = runs["layerwise"]
    assert layer.summary["pinned"] and layer.recorder.overlap_ms() > 0, "copies never overlapped compute"
    peak = {m: r.summary["peak_device_bytes"] for m, r in runs.items()}
    assert peak["sequential"] <= peak["layerwise"] < peak["model"] < peak["none"]


@pytest.mark.cuda
def test_cuda_no_host_sync_inside_the_layerwise_block_loop(engines):
    cfg = DiffusionConfig(width=256, heads=4, denoiser_layers=6, latent_tokens=256, steps=2)
    pipe = ToyDiffusionPipeline(cfg)
    device = torch.device("cuda")
    with torch.no_grad():
        handle = engines.LayerwiseOffload(pipe.denoiser.blocks, device, prefetch_depth=2, pinned=True)
        for name in ("text_encoder", "decoder"):
            pipe.components()[name].to(device)
        for p in pipe.denoiser.parameters():
            if p.numel():
                p.data = p.data.to(device)
        prompt, noise = pipe.inputs(0, device)
        text = pipe.encode(prompt)
        latents = pipe.denoise_step(noise, text, 0)  # warm up the allocator
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in range(cfg.steps):
                latents = pipe.denoise_step(latents, text, step)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        handle.remove()
    assert torch.isfinite(latents).all()
