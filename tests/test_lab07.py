"""Lab 07: optimizer and gradient offload against device AdamW: equal parameters, device bytes saved
exactly, gradients copied inside backward, transfer accounting, the CPU AdamW benchmark, bad input."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from conftest import ROOT, assert_clean_usage_error, assert_usage_error_in_process, load_lab, run_cli
from labkit.ledger import CATEGORIES

from labkit import GPTConfig, SyntheticTokens, TinyGPT

SCRIPT = "lab-07-optimizer-offload/optimizer_offload.py"
SMALL = ["--device", "cpu", "--json", "--width", "32", "--layers", "2", "--heads", "2", "--seq-len", "16",
         "--vocab", "64", "--batch-size", "4", "--steps", "3"]
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread_in_subprocesses(monkeypatch):
    """The lab's subprocesses run tiny tensors too: one thread, as conftest gives this process."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def lab07():
    return load_lab(SCRIPT)


def run(lab07, mode, *extra):
    return lab07.run_mode(mode, lab07.parse_args([*SMALL, *extra]), CPU)


@pytest.fixture(scope="module")
def fused_runs(lab07):
    """The three modes with fused AdamW on both sides (the default), under the ledger."""
    return {mode: run(lab07, mode) for mode in lab07.MODES}


def sizes(model):
    params = list(model.parameters())
    return sum(p.numel() for p in params), len(params)


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.model.parameters(), b.model.parameters()))


def test_offload_equals_device_adamw_bit_for_bit_with_fused_adamw(fused_runs):
    reference = fused_runs["none"]
    for mode in ("optimizer", "gradients"):
        r = fused_runs[mode]
        assert r.losses == reference.losses, mode
        for p, q in zip(r.model.parameters(), reference.model.parameters()):
            assert torch.equal(p, q), mode  # same kernel, same inputs, same order: same bits


@pytest.mark.parametrize("mode", ["optimizer", "gradients"])
def test_offload_equals_device_adamw_bit_for_bit_with_the_for_loop(lab07, mode):
    assert max_diff(run(lab07, mode, "--impl", "forloop"), run(lab07, "none", "--impl", "forloop")) == 0.0


def test_fused_against_the_for_loop_differs_only_by_rounding(lab07, fused_runs):
    """Two orders of fp32 arithmetic: not the same bits, but within 1% of what AdamW can move in N steps."""
    loop = run(lab07, "none", "--impl", "forloop")
    args = lab07.parse_args(SMALL)
    tolerance = 0.01 * args.lr * args.steps  # each step moves a parameter by about lr at most
    assert max_diff(fused_runs["optimizer"], loop) <= tolerance
    assert fused_runs["optimizer"].losses == pytest.approx(loop.losses, rel=1e-5)


def test_device_bytes_saved_are_exact(lab07, fused_runs):
    n, t = sizes(fused_runs["none"].model)
    summaries = {m: lab07.summary(r, fused_runs["none"]) for m, r in fused_runs.items()}
    none, opt, grads = (summaries[m]["device_after_step"] for m in lab07.MODES)
    assert none["optimizer_state"] == 8 * n + 4 * t  # two fp32 moments + a 4-byte step per tensor
    assert opt["optimizer_state"] == grads["optimizer_state"] == 0
    assert none["parameters"] == opt["parameters"] == grads["parameters"] == 4 * n
    assert none["gradients"] == opt["gradients"] == 4 * n and grads["gradients"] == 0
    assert summaries["optimizer"]["device_saved_bytes"] == 8 * n + 4 * t
    assert summaries["gradients"]["device_saved_bytes"] == 12 * n + 4 * t
    assert summaries["optimizer"]["device_saved_per_param"] == pytest.approx(8, abs=4 * t / n + 1e-12)
    # the step's peak carries the AdamW state in device AdamW only: it drops by exactly that much
    peak = {m: s["peak_device_bytes"] for m, s in summaries.items()}
    assert peak["none"] - peak["optimizer"] == 8 * n + 4 * t
    assert peak["gradients"] <= peak["optimizer"]


def test_host_side_is_labelled_host_copies(lab07, fused_runs):
    """On CPU the device and the host are the same RAM: the host_copies label keeps them apart, exactly."""
    n, t = sizes(fused_runs["none"].model)
    for mode in ("optimizer", "gradients"):
        r = fused_runs[mode]
        master = r.optimizer.master.nbytes  # Lab 08's flat buffer: every parameter 64-byte aligned
        assert master >= 4 * n and r.optimizer.grad_flat.nbytes == master
        tl = r.ledger.timeline()
        assert tl.host["host_copies"][-1] == 2 * master + 8 * n + 4 * t  # master, gradients, AdamW state
        assert not any(tl.device["host_copies"]) and not any(tl.device["optimizer_state"])
    assert not any(fused_runs["none"].ledger.timeline().host["host_copies"])


def test_gradient_offload_holds_one_module_of_gradients_at_a_time(fused_runs):
    r = fused_runs["gradients"]
    tl = r.ledger.timeline()
    largest_module = max(sum(p.nbytes for p in m.parameters(recurse=False)) for m in r.model.modules())
    assert 0 < max(tl.device["gradients"]) <= largest_module
    n, _ = sizes(r.model)
    assert largest_module < 4 * n // 2  # far from all of them
    for span in tl.spans:
        if span.name == "optimizer":
            assert not any(tl.device["gradients"][span.start:span.end])


@pytest.mark.parametrize("offload_grads", [False, True])
def test_every_gradient_reaches_the_host_during_backward(lab07, offload_grads):
    cfg = GPTConfig(vocab=64, seq_len=16, width=32, layers=2, heads=2, dropout=0.0)
    torch.manual_seed(0)
    model, twin = TinyGPT(cfg), TinyGPT(cfg)
    twin.load_state_dict(model.state_dict())
    x, y = SyntheticTokens(cfg.vocab, cfg.seq_len).batch(0, 4)
    engine = lab07.OptimizerOffload(model.parameters(), 1e-3, 0.0, offload_grads=offload_grads)
    model(x, y)[1].backward()
    twin(x, y)[1].backward()
    params = list(model.parameters())
    assert sorted(engine.arrived) == list(range(len(params)))  # every hook fired, inside backward
    assert params[engine.arrived[0]] is model.head.weight  # backward reaches the head first
    for host, p, q in zip(engine.host, params, twin.parameters()):
        assert torch.equal(host.grad, q.grad)
        assert (p.grad is None) is offload_grads
    n, _ = sizes(model)
    assert engine.d2h_bytes == 4 * n
    engine.step()
    assert engine.h2d_bytes == 4 * n and engine.arrived == []
    for host, p in zip(engine.host, model.parameters()):
        assert torch.equal(host, p)  # the updated parameters are back on the device
    engine.remove()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


@pytest.mark.parametrize("impl", ["fused", "forloop"])
def test_one_host_step_leaves_a_parameter_without_gradient_alone_like_device_adamw(lab07, impl):
    """One AdamW over every host parameter: a parameter that backward did not reach this step must
    not be stepped (not even decayed), exactly as device AdamW skips a parameter whose .grad is None."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"always": torch.nn.Linear(8, 4), "once": torch.nn.Linear(8, 4)})
    twin = torch.nn.ModuleDict({"always": torch.nn.Linear(8, 4), "once": torch.nn.Linear(8, 4)})
    twin.load_state_dict(model.state_dict())
    engine = lab07.OptimizerOffload(model.parameters(), 1e-2, 0.1, impl)
    device = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1, **lab07.IMPLS[impl])
    for step in range(4):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        for m, opt in ((model, engine), (twin, device)):
            opt.zero_grad()
            y = m["always"](x) + (m["once"](x) if step in (0, 3) else 0)  # "once": no gradient in steps 1, 2
            y.square().sum().backward()
            opt.step()
    assert len(engine.optimizer.param_groups[0]["params"]) == 4  # one optimizer for all of them
    for p, q, host in zip(model.parameters(), twin.parameters(), engine.host):
        assert torch.equal(p, q) and torch.equal(host, p)  # the host master was not stepped in steps 1, 2
    engine.remove()


def test_transfer_bytes_per_step(lab07, fused_runs):
    n, _ = sizes(fused_runs["none"].model)
    s = lab07.summary(fused_runs["gradients"], fused_runs["none"])
    assert s["d2h_bytes_per_step"] == s["h2d_bytes_per_step"] == 4 * n  # one gradient down, one parameter up


def test_json_summary_schema():
    proc = run_cli(SCRIPT, *SMALL, "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert [m["mode"] for m in data["modes"]] == ["none", "optimizer", "gradients"]
    for m in data["modes"]:
        assert len(m["losses"]) == 2 and m["max_abs_diff_vs_device_adamw"] == 0.0
        assert set(m["device_after_step"]) == set(CATEGORIES)
    assert data["impl"] == "fused" and data["provenance"]["source_hash"]
    assert data["provenance"]["device_type"] == "cpu"
    assert proc.stderr == ""


def test_one_mode_is_reported_alone(lab07, capsys):
    lab07.main([*SMALL, "--offload", "gradients", "--steps", "1"])
    data = json.loads(capsys.readouterr().out)
    assert [m["mode"] for m in data["modes"]] == ["gradients"]
    assert data["modes"][0]["device_saved_per_param"] > 12


def test_human_report(lab07, capsys):
    lab07.main([a for a in SMALL if a != "--json"] + ["--steps", "1"])
    out = capsys.readouterr().out
    assert "the device and the host are the same RAM" in out
    assert out.count("\n") >= 5 and "gradients" in out and "12.0" in out


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--steps", "0"], "--steps"),
        (["--offload", "everything"], "--offload"),
        (["--impl", "adam8bit"], "--impl"),
        (["--overlap", "maybe"], "--overlap"),
        (["--weight-decay", "-1"], "--weight-decay"),
        (["--weight-decay", "nan"], "--weight-decay: must be a finite number"),
        (["--weight-decay", "inf"], "--weight-decay: must be a finite number"),
        (["--width", "30", "--heads", "4"], "not divisible"),
        (["--lr", "0"], "--lr"),
        (["--snapshot", "x.pickle"], "needs a CUDA device"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(lab07, capsys, args, fragment):
    assert_usage_error_in_process(lab07.main, [*SMALL, *args], capsys, fragment)


def test_a_torch_without_fused_cpu_adamw_is_refused_clearly(lab07, capsys, monkeypatch):
    monkeypatch.setattr(lab07, "fused_cpu_adamw_available", lambda: False)
    assert_usage_error_in_process(lab07.main, SMALL, capsys, "no fused CPU AdamW", "--impl foreach")
    lab07.parse_args([*SMALL, "--impl", "forloop"])  # the other implementations still run


def test_fused_cpu_adamw_exists_in_this_torch(lab07):
    assert lab07.fused_cpu_adamw_available()  # torch >= 2.4; the requirements pin 2.13


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_gpu_is_one_line():
    assert_clean_usage_error(run_cli(SCRIPT, "--device", "cuda", "--steps", "1"), "no CUDA GPU")


def test_bad_impl_from_the_command_line():
    assert_clean_usage_error(run_cli(SCRIPT, "--impl", "apex"), "--impl")


def test_nan_weight_decay_from_the_command_line():
    assert_clean_usage_error(run_cli(SCRIPT, "--device", "cpu", "--weight-decay", "nan"), "finite number")


# ------------------------------------------------------------------ the CPU AdamW benchmark
@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("cpu_adam_bench", ROOT / "bench" / "cpu_adam_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_adam_bench_tiny_run_writes_results(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench.main(["--device", "cpu", "--sizes", "32x1", "--rounds", "2", "--overhead", "on", "--steps", "2",
                "--out", str(out), "--json"])
    printed = json.loads(capsys.readouterr().out)
    data = json.loads(out.read_text())
    assert data["provenance"]["device_type"] == "cpu" and data["provenance"]["source_hash"]
    assert printed["sets"] == data["sets"] and "no GPU, PCIe or overlap claim" in data["note"]
    (s,) = data["sets"]
    assert s["width"] == 32 and s["params"] == sum(p.numel() for p in TinyGPT(GPTConfig(width=32, layers=1)).parameters())
    assert set(s["impls"]) == {"fused", "foreach", "forloop"}
    assert s["impls"]["forloop"]["speedup_vs_forloop"] == 1.0 and s["impls"]["forloop"]["max_abs_diff_vs_forloop"] == 0
    for r in s["impls"].values():
        assert r["ms_median"] > 0 and r["max_abs_diff_vs_forloop"] <= 1e-6  # 3 steps of lr 1e-3: rounding only
    modes = [(r["mode"], r["overlap"]) for r in data["offload_overhead"]]
    assert modes == [("none", None), ("optimizer", True), ("optimizer", False), ("gradients", True), ("gradients", False)]
    assert data["offload_overhead"][0]["step_time_vs_device_adamw"] == 1.0
    table = out.with_suffix(".md").read_text()
    assert "| `fused` |" in table and "Measured by `bench/cpu_adam_bench.py`" in table


@pytest.mark.parametrize(("args", "fragment"), [(["--sizes", "128"], "WIDTHxLAYERS"),
                                                (["--sizes", "128x0"], "WIDTHxLAYERS"),
                                                (["--rounds", "0"], "--rounds")])
def test_cpu_adam_bench_bad_input(bench, capsys, args, fragment):
    assert_usage_error_in_process(bench.main, args, capsys, fragment)


def test_committed_cpu_adam_bench_result_has_provenance():
    data = json.loads((ROOT / "results" / "cpu_adam_bench.json").read_text())
    assert data["provenance"]["lab"] == "lab-07-optimizer-offload" and data["provenance"]["git_commit"]
    assert {"fused", "foreach", "forloop"} == set(data["sets"][0]["impls"])
    assert (ROOT / "results" / "cpu_adam_bench.md").read_text().startswith("| parameters (tensors) |")


# ------------------------------------------------------------------ GPU only
@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["optimizer", "gradients"])
@pytest.mark.parametrize("overlap", ["on", "off"])
def test_cuda_offload_matches_device_adamw_within_tolerance(lab07, mode, overlap):
    gpu = ["--device", "cuda", "--json", "--steps", "3", "--dropout", "0", "--overlap", overlap]
    args = lab07.parse_args(gpu)
    device = torch.device("cuda", torch.cuda.current_device())
    reference = lab07.run_mode("none", args, device)  # each run moves its model off the GPU when it ends
    r = lab07.run_mode(mode, args, device)
    assert max_diff(r, reference) <= 0.01 * args.lr * args.steps  # CUDA and CPU kernels round differently
    assert all(b.is_pinned() for b in (r.optimizer.master.flat, r.optimizer.grad_flat))
    n, _ = sizes(r.model)
    saved = reference.cuda["max_memory_allocated"] - r.cuda["max_memory_allocated"]
    assert saved >= 8 * n  # the AdamW state is not on the GPU


@pytest.mark.cuda
def test_cuda_backward_never_waits_for_the_host_copies(lab07):
    """With overlap, the gradient hooks only queue work: no host synchronisation inside backward.

    A stack of Linear layers, not TinyGPT: an embedding's backward may synchronise on its own.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(device)
    engine = lab07.OptimizerOffload(model.parameters(), 1e-3, 0.0, offload_grads=True, overlap=True)
    loss = model(torch.randn(64, 256, device=device)).square().mean()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(p.grad is None for p in model.parameters()) and len(engine.arrived) == 4
    engine.step()
    torch.cuda.synchronize()
    assert engine.h2d_bytes == engine.d2h_bytes == 4 * sizes(model)[0]
    for host, p in zip(engine.host, model.parameters()):
        assert torch.equal(host, p.detach().cpu())
