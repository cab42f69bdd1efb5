"""Lab 07: optimizer and gradient offload against device AdamW: equal parameters, device bytes saved
exactly (fp32 and bf16 weights), gradients copied inside backward, transfer accounting, the trace on
fake tensors against the real run, the real-scale claims, the CPU AdamW benchmark, bad input."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import sys

import pytest
import torch
from conftest import ROOT, assert_clean_usage_error, assert_usage_error_in_process, load_lab, run_cli

from labkit import GPTConfig, SyntheticTokens, TinyGPT, fake, zoo
from labkit.schedule import Copies
from labkit.timeline import CATEGORIES
from test_labkit_fake import assert_same_timeline

SCRIPT = "lab-07-optimizer-offload/optimizer_offload.py"
SIZE = {"device": "cpu", "width": 32, "layers": 2, "heads": 2, "seq_len": 16, "vocab": 64, "batch_size": 4, "steps": 3}
SMALL = ["--device", "cpu", "--width", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--vocab", "64",
         "--batch-size", "4", "--steps", "3"]  # the same, as a user types it
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def lab07():
    return load_lab(7)


@pytest.fixture(scope="module")
def accounting():
    return load_lab(7, "offload_accounting")


def train(lab07, mode, measured=True, **extra):
    return lab07.run_mode(mode, lab07.Config(**SIZE, **extra), CPU, measured=measured)


@pytest.fixture(scope="module")
def fused_runs(lab07):
    """The three modes with fused AdamW on both sides (the default), under the ledger."""
    return lab07.Result(lab07.Config(**SIZE), CPU, [train(lab07, mode) for mode in lab07.MODES])


def sizes(model):
    params = list(model.parameters())
    return sum(p.numel() for p in params), len(params)


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.model.parameters(), b.model.parameters()))


def test_offload_equals_device_adamw_bit_for_bit_with_fused_adamw(fused_runs):
    runs = {r.mode: r for r in fused_runs.runs}
    for mode in ("optimizer", "gradients"):
        assert runs[mode].losses == runs["none"].losses, mode
        for p, q in zip(runs[mode].model.parameters(), runs["none"].model.parameters()):
            assert torch.equal(p, q), mode  # same kernel, same inputs, same order: same bits


@pytest.mark.parametrize("impl", ["forloop", "foreach"])
@pytest.mark.parametrize("mode", ["optimizer", "gradients"])
def test_offload_equals_device_adamw_bit_for_bit_with_the_other_implementations(lab07, mode, impl):
    offload, device = train(lab07, mode, measured=False, impl=impl), train(lab07, "none", measured=False, impl=impl)
    assert max_diff(offload, device) == 0.0 and offload.losses == device.losses


def test_fused_against_the_for_loop_differs_only_by_rounding_where_the_gradient_is_noise(lab07, accounting,
                                                                                         fused_runs):
    """Two orders of fp32 arithmetic: not the same bits, but within 1% of what AdamW can move in N
    steps. The largest difference sits in attention's key bias, whose exact gradient is zero."""
    loop = train(lab07, "none", measured=False, impl="forloop")
    offload = next(r for r in fused_runs.runs if r.mode == "optimizer")
    diff, where = accounting.largest_difference(offload.model, loop.model)
    assert 0 < diff <= accounting.tolerance(fused_runs.config.lr, fused_runs.config.steps)
    assert where.endswith("qkv.bias (key part)"), where
    assert offload.losses == pytest.approx(loop.losses, rel=1e-5)


def test_device_bytes_saved_are_exact(fused_runs):
    n, t = sizes(fused_runs.runs[0].model)
    summaries = fused_runs.modes()
    none, opt, grads = (summaries[m]["device_after_step"] for m in ("none", "optimizer", "gradients"))
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


def test_every_formula_of_the_checks_table_equals_the_measurement(accounting, fused_runs):
    engine = next(r.optimizer for r in fused_runs.runs if r.optimizer)
    table = accounting.checks(fused_runs.modes(), engine)
    assert len(table.rows) == 7
    for quantity, formula, derived, measured in table.rows:
        assert derived == measured, (quantity, formula)


def test_bytes_per_parameter_are_the_derived_ones_plus_step_counters_and_alignment(accounting, fused_runs):
    n, t = sizes(fused_runs.runs[0].model)
    for where, what, *cells in accounting.bytes_per_param(fused_runs.modes()).rows:
        for derived, measured in zip(cells[::2], cells[1::2]):
            assert derived <= measured < derived + (4 * t + 64 * t) / n, (where, what)


def test_host_side_is_labelled_host_copies(fused_runs):
    """On CPU the device and the host are the same RAM: the host_copies label keeps them apart, exactly."""
    n, t = sizes(fused_runs.runs[0].model)
    for r in fused_runs.runs[1:]:
        master = r.optimizer.master.nbytes  # Lab 08's flat buffer: every parameter 64-byte aligned
        assert master >= 4 * n and r.optimizer.grad_flat.nbytes == master
        tl = r.ledger.timeline()
        assert tl.host["host_copies"][-1] == 2 * master + 8 * n + 4 * t  # master, gradients, AdamW state
        assert not any(tl.device["host_copies"]) and not any(tl.device["optimizer_state"])
    assert not any(fused_runs.runs[0].ledger.timeline().host["host_copies"])


def test_gradient_offload_holds_one_module_of_gradients_at_a_time(fused_runs):
    r = fused_runs.runs[2]
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
    n, _ = sizes(model)
    with Copies(engine.host_buffers()) as copies:  # bytes into the host buffers and out of them
        model(x, y)[1].backward()
        twin(x, y)[1].backward()
        params = list(model.parameters())
        assert sorted(engine.arrived) == list(range(len(params)))  # every hook fired, inside backward
        assert params[engine.arrived[0]] is model.head.weight  # backward reaches the head first
        for host, p, q in zip(engine.host, params, twin.parameters()):
            assert torch.equal(host.grad, q.grad)
            assert (p.grad is None) is offload_grads
        assert (copies.into, copies.out_of) == (4 * n, 0)
        engine.step()
    assert (copies.into, copies.out_of) == (4 * n, 4 * n) and engine.arrived == []
    for host, p in zip(engine.host, model.parameters()):
        assert torch.equal(host, p)  # the updated parameters are back on the device
    engine.remove()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


class StubEvent:
    """A CUDA event stand-in: ``done`` says whether its copy has run."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_released_gradients_are_kept_until_their_copy_has_run(lab07, monkeypatch):
    """The keep-alive policy of gradient offload, without a GPU: a device gradient is let go only once
    its copy's event has completed, or, past the in-flight limit, after the compute stream was told to
    wait for that event."""
    waited = []
    compute = type("Compute", (), {"wait_event": lambda self, e: waited.append(e)})()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    engine = lab07.OptimizerOffload([torch.zeros(4, requires_grad=True)], 1e-3, 0.0, offload_grads=True,
                                    in_flight=2)
    grads = [torch.zeros(4) for _ in range(4)]
    events = [StubEvent(done=False), StubEvent(done=True), StubEvent(done=False), StubEvent(done=False)]
    engine.in_flight.extend(zip(grads[:2], events[:2]))
    engine._release(engine.max_in_flight)
    assert len(engine.in_flight) == 2 and waited == []  # the oldest copy has not run: both are kept
    events[0].done = True
    engine._release(engine.max_in_flight)
    assert list(engine.in_flight) == [] and waited == events[:2]  # landed: let go, in order
    engine.in_flight.extend(zip(grads[2:], events[2:]))
    engine.in_flight.append((torch.zeros(4), StubEvent(done=False)))
    engine._release(engine.max_in_flight)  # three outstanding, limit two: the oldest is waited for
    assert waited[-1] is events[2] and [e for _, e in engine.in_flight] == [events[3], engine.in_flight[1][1]]
    engine.remove()


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


def test_transfer_bytes_per_step(fused_runs):
    n, _ = sizes(fused_runs.runs[0].model)
    s = fused_runs.modes()["gradients"]
    assert s["d2h_bytes_per_step"] == s["h2d_bytes_per_step"] == 4 * n  # one gradient down, one parameter up


def test_json_summary_schema():
    proc = run_cli(SCRIPT, *SMALL, "--steps", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert [m["mode"] for m in data["modes"]] == ["none", "optimizer", "gradients"]
    for m in data["modes"]:
        assert len(m["losses"]) == 2 and m["max_abs_diff_vs_device_adamw"] == 0.0
        assert set(m["device_after_step"]) == set(CATEGORIES)
    assert data["config"]["impl"] == "fused" and data["provenance"]["source_hash"]
    assert data["provenance"]["device_type"] == "cpu"
    assert proc.stderr == ""


def test_one_mode_is_reported_alone(lab07):
    result = lab07.run(lab07.Config(**{**SIZE, "steps": 1}, offload="gradients"))
    assert [r.mode for r in result.runs] == ["none", "gradients"]  # device AdamW: the reference
    (mode,) = result.summary()["modes"]
    assert mode["mode"] == "gradients" and mode["device_saved_per_param"] > 12


def test_human_report():
    proc = run_cli(SCRIPT, *SMALL, "--steps", "1")
    assert proc.returncode == 0, proc.stderr
    assert "the device and the host are the same RAM" in proc.stdout
    assert "12.00" in proc.stdout and "host to device per step" in proc.stdout  # saved per parameter; the checks


@pytest.mark.parametrize(("fields", "fragment"), [({"width": 30, "heads": 4}, "not divisible")])
def test_the_config_refuses_what_cannot_run(lab07, fields, fragment):
    with pytest.raises(lab07.UsageError, match=fragment):
        lab07.Config(**{**SIZE, **fields})


def test_a_torch_without_fused_cpu_adamw_is_refused_clearly(lab07, monkeypatch):
    monkeypatch.setattr(lab07, "fused_cpu_adamw_available", lambda: False)
    with pytest.raises(lab07.UsageError, match="no fused CPU AdamW.*--impl foreach"):
        lab07.Config(**SIZE)
    lab07.Config(**SIZE, impl="forloop")  # the other implementations still run


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_snapshot_on_cpu_is_refused(lab07, capsys, tmp_path):
    assert_usage_error_in_process(lab07, [*SMALL, "--snapshot", str(tmp_path / "s.pickle")], capsys,
                                  "needs a CUDA device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_gpu_is_one_line():
    assert_clean_usage_error(run_cli(SCRIPT, "--device", "cuda", "--steps", "1"), "no CUDA GPU")


# ------------------------------------------------------------------ bf16 weights, fp32 master and AdamW state
@pytest.fixture(scope="module")
def bf16_runs(lab07):
    """The three modes with bf16 device weights: device AdamW keeps an fp32 master on the device."""
    return lab07.Result(lab07.Config(**SIZE, precision="bf16"), CPU,
                        [train(lab07, mode, precision="bf16") for mode in lab07.MODES])


def test_bf16_offload_equals_device_master_adamw_bit_for_bit(bf16_runs):
    """Both sides widen the bf16 gradients to fp32, step an fp32 master and round it back to bf16."""
    runs = {r.mode: r for r in bf16_runs.runs}
    assert all(p.dtype == torch.bfloat16 for p in runs["none"].model.parameters())
    for mode in ("optimizer", "gradients"):
        assert runs[mode].losses == runs["none"].losses, mode
        for p, q in zip(runs[mode].model.parameters(), runs["none"].model.parameters()):
            assert torch.equal(p, q), mode


def test_bf16_every_formula_of_the_checks_table_equals_the_measurement(accounting, bf16_runs):
    """12 B/P off the device (fp32 master and moments), 18 B/P on the host (with the bf16 staging
    buffer), and 2 B/P over the bus each way: the host's own bf16/fp32 conversions are not counted."""
    n, t = sizes(bf16_runs.runs[0].model)
    engine = next(r.optimizer for r in bf16_runs.runs if r.optimizer)
    table = accounting.checks(bf16_runs.modes(), engine, "bf16")
    for quantity, formula, derived, measured in table.rows:
        assert derived == measured, (quantity, formula)
    opt = bf16_runs.modes()["optimizer"]
    assert opt["device_saved_bytes"] == 12 * n + 4 * t and opt["d2h_bytes_per_step"] == opt["h2d_bytes_per_step"] == 2 * n
    for where, what, *cells in accounting.bytes_per_param(bf16_runs.modes(), "bf16").rows:
        for derived, measured in zip(cells[::2], cells[1::2]):
            assert derived <= measured < derived + (4 * t + 64 * 2 * t) / n, (where, what)


# ------------------------------------------------------------------ real scale, traced on fake tensors
@pytest.fixture
def exact_traces(lab07, monkeypatch):
    """The lab's ``--fake`` run with exact bytes (``fake.tensors(block=None)``), as a real CPU run counts
    them: the trace goes through the same ``run_mode`` as the real run, only the tensors differ."""
    monkeypatch.setattr(lab07.Config, "tensors",
                        lambda self: fake.tensors(block=None) if self.fake else contextlib.nullcontext())


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("mode", ["none", "optimizer", "gradients"])
def test_the_trace_on_fake_tensors_is_the_real_run_to_the_byte(lab07, exact_traces, mode, precision):
    """small-llama, real against fake: the same allocations and frees in order, the same peaks by
    phase and category, the same host buffers and the same bytes over the bus."""
    size = {**SIZE, "steps": 2, "model": "small-llama", "precision": precision}
    real = lab07.run_mode(mode, lab07.Config(**size), CPU)
    traced = lab07.run_mode(mode, lab07.Config(**size, fake=True), CPU)
    assert fake.is_fake(next(traced.model.parameters())) and not fake.is_fake(next(real.model.parameters()))
    assert_same_timeline(real.ledger, traced.ledger)
    assert real.ledger.timeline().host == traced.ledger.timeline().host
    if mode != "none":
        assert (real.copies.into, real.copies.out_of) == (traced.copies.into, traced.copies.out_of) != (0, 0)


@pytest.fixture(scope="module")
def llama_8b_two_layers(lab07):
    """Llama-3-8B's width, heads, MLP and 128k vocabulary, two of its 32 layers, 4096 tokens, bf16:
    the page's real-scale claims, checked at a real shape in about a second."""
    spec = dataclasses.replace(zoo.get("llama-3-8b"), layers=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lab07.Config, "model_spec", lambda self: spec)
        result = lab07.run(lab07.Config(model="llama-3-8b", fake=True, precision="bf16", seq_len=4096,
                                        batch_size=1, steps=2))
    assert result.summary()["traced"] and all(r.losses == [] for r in result.runs)
    return result


def test_at_real_scale_offload_takes_the_fp32_master_and_moments_off_the_device(accounting, llama_8b_two_layers):
    modes = llama_8b_two_layers.modes()
    n = modes["none"]["params"]
    assert n == dataclasses.replace(zoo.get("llama-3-8b"), layers=2).param_count()
    block = 512 * modes["none"]["tensors"]  # the trace rounds every storage to the CUDA allocator's blocks
    none, opt = modes["none"], modes["optimizer"]
    assert none["device_after_step"]["optimizer_state"] >= 12 * n  # fp32 master and two moments, on the device
    assert opt["device_after_step"]["optimizer_state"] == 0
    assert sum(opt["device_after_step"][c] for c in ("parameters", "gradients")) <= 4 * n + 2 * block  # bf16 w + g
    assert none["peak_device_bytes"] - opt["peak_device_bytes"] >= 12 * n
    # master, fp32 gradients, two moments and the bf16 staging: 18 B/P, plus 64-byte alignment, step counters, blocks
    assert 18 * n <= opt["host_bytes"] < 18 * n + 5 * block
    assert opt["d2h_bytes_per_step"] == opt["h2d_bytes_per_step"] == 2 * n  # bf16 both ways, nothing else
    assert opt["host_bytes"] > sum(none["device_after_step"][c] for c in accounting.MODEL_STATE)  # moved, not removed
    assert none["peak_phase"] == "optimizer"  # device AdamW widens every gradient to fp32 for its step


def test_at_real_scale_the_host_side_is_labelled_and_left_out_of_the_device_peak(llama_8b_two_layers):
    for r in llama_8b_two_layers.runs:
        tl = r.ledger.timeline()
        assert not any(tl.device["host_copies"])  # host bytes never count as device bytes
        if r.optimizer:
            assert tl.host["host_copies"][-1] == llama_8b_two_layers.mode_summary(r)["host_bytes"] > 0
            assert not any(b.is_pinned() for b in r.optimizer.host_buffers())  # CUDA only; a trace runs on CPU


def test_at_long_sequences_gradient_offload_leaves_the_peak_where_it_was(llama_8b_two_layers):
    """The peak of a 4096-token step is at the start of backward, before any gradient exists: freeing
    each gradient once copied lowers the state between steps, not the peak."""
    modes = llama_8b_two_layers.modes()
    assert modes["gradients"]["peak_device_bytes"] == modes["optimizer"]["peak_device_bytes"]
    assert modes["optimizer"]["peak_phase"] == modes["gradients"]["peak_phase"] == "backward"
    assert modes["optimizer"]["device_at_peak"]["gradients"] == 0 < modes["optimizer"]["device_at_peak"]["activations"]
    assert modes["gradients"]["device_after_step"]["gradients"] == 0 < modes["optimizer"]["device_after_step"]["gradients"]


def test_fake_run_from_the_command_line_reports_bytes_and_no_values():
    proc = run_cli(SCRIPT, "--model", "small-llama", "--fake", "--precision", "bf16", "--seq-len", "16",
                   "--batch-size", "2", "--steps", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["traced"].startswith("traced on fake tensors") and data["config"]["model"] == "small-llama"
    for m in data["modes"]:
        assert m["losses"] == [] and m["max_abs_diff_vs_device_adamw"] is None and m["step_ms"] is None
    assert data["modes"][1]["d2h_bytes_per_step"] == 2 * data["modes"][1]["params"]


# ------------------------------------------------------------------ the CPU AdamW benchmark
@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("cpu_adam_bench", ROOT / "bench" / "cpu_adam_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up by name
    spec.loader.exec_module(module)
    return module


def test_cpu_adam_bench_tiny_run_writes_results(bench, tmp_path):
    out = tmp_path / "bench.json"
    result = bench.run(bench.Config(device="cpu", sizes=((32, 1),), rounds=2, overhead="on", steps=2, out=out))
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result.summary()))  # the file is what --json prints
    assert data["provenance"]["device_type"] == "cpu" and data["provenance"]["source_hash"]
    assert data["provenance"]["lab"] == "lab-07-optimizer-offload"
    assert "no GPU, PCIe or overlap claim" in data["note"]
    (s,) = data["sets"]
    assert s["width"] == 32 and s["params"] == sum(p.numel() for p in TinyGPT(GPTConfig(width=32, layers=1)).parameters())
    assert set(s["impls"]) == {"fused", "foreach", "forloop"}
    assert s["impls"]["forloop"]["speedup_vs_forloop"] == 1.0 and s["impls"]["forloop"]["max_abs_diff_vs_forloop"] == 0
    for r in s["impls"].values():
        assert r["ms_median"] > 0 and r["max_abs_diff_vs_forloop"] <= 1e-6  # 3 steps of lr 1e-3: rounding only
    modes = [(r["mode"], r["overlap"]) for r in data["offload_overhead"]]
    assert modes == [("none", None), ("optimizer", True), ("optimizer", False), ("gradients", True), ("gradients", False)]
    assert data["offload_overhead"][0]["step_time_vs_device_adamw"] == 1.0
    assert [row[2] for row in bench.table(data).rows] == ["fused", "foreach", "forloop"]
    assert not list(tmp_path.glob("*.md"))  # numbers only: pages render them


@pytest.mark.parametrize("sizes", ["128", "128x0", "128x2,"])
def test_cpu_adam_bench_bad_sizes(bench, capsys, sizes):
    assert_usage_error_in_process(bench, ["--sizes", sizes], capsys, "WIDTHxLAYERS")


def test_cpu_adam_bench_takes_any_width(bench):
    """--sizes 200x3 was a traceback (200 // 64 = 3 heads do not divide 200): heads change no
    parameter's shape, so the bench picks a count that divides the width."""
    params, _ = bench.parameter_set(200, 1, 0)
    assert sum(p.numel() for p in params) == sum(p.numel() for p in TinyGPT(GPTConfig(width=200, layers=1, heads=2)).parameters())


def test_committed_cpu_adam_bench_result_has_provenance(bench):
    data = json.loads((ROOT / "results" / "cpu_adam_bench.json").read_text())
    assert data["provenance"]["lab"] == "lab-07-optimizer-offload" and data["provenance"]["git_commit"]
    assert {"fused", "foreach", "forloop"} == set(data["sets"][0]["impls"])
    assert len(bench.table(data).rows) == 3 * len(data["sets"])


# ------------------------------------------------------------------ GPU only
@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["optimizer", "gradients"])
@pytest.mark.parametrize("overlap", ["on", "off"])
def test_cuda_offload_matches_device_adamw_within_tolerance(lab07, accounting, mode, overlap):
    config = lab07.Config(device="cuda", steps=3, dropout=0.0, overlap=overlap)
    device = torch.device("cuda", torch.cuda.current_device())
    reference = lab07.run_mode("none", config, device)  # each run moves its model off the GPU when it ends
    r = lab07.run_mode(mode, config, device)
    assert max_diff(r, reference) <= accounting.tolerance(config.lr, config.steps)  # CUDA and CPU kernels round differently
    assert all(b.is_pinned() for b in r.optimizer.host_buffers())
    n, _ = sizes(r.model)
    saved = reference.cuda["max_memory_allocated"] - r.cuda["max_memory_allocated"]
    assert saved >= 8 * n  # the AdamW state is not on the GPU
    summary = lab07.Result(config, device, [reference, r]).modes()[mode]
    assert summary["d2h_bytes_per_step"] == summary["h2d_bytes_per_step"] == 4 * n  # counted on the autograd thread too


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
    for host, p in zip(engine.host, model.parameters()):
        assert torch.equal(host, p.detach().cpu())
