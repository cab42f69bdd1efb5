"""labkit's other instruments: device choice, the CLI pattern, provenance, plots, toy models."""

from __future__ import annotations

import json

import pytest
import torch

from labkit import GPTConfig, Ledger, SyntheticTokens, TinyGPT, UsageError, pick_device, run_lab
from labkit import provenance as prov
from labkit.cli import lab_parser, progress
from labkit.models import gpt_param_count
from labkit.plot import decimate, format_bytes, peak_table, plot_timeline, save


# ---------------------------------------------------------------- device and CLI
def test_auto_and_cpu_devices():
    assert pick_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device("auto").type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_usage_error():
    with pytest.raises(UsageError, match="no CUDA GPU"):
        pick_device("cuda")


def test_unknown_device_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown device"):
        pick_device("tpu")


def test_parser_errors_are_one_line_and_exit_2(capsys):
    parser = lab_parser("test", prog="lab.py")
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--device", "tpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lab.py: error:") and "tpu" in err[0]


def test_run_lab_turns_usage_errors_into_one_line_and_exit_2(capsys):
    def main(argv):
        raise UsageError("steps must be positive")

    with pytest.raises(SystemExit) as exc:
        run_lab(main, [], prog="lab.py")
    assert exc.value.code == 2
    assert capsys.readouterr().err == "lab.py: error: steps must be positive\n"


@pytest.mark.parametrize("argv, fragment", [
    (["--rate", "inf"], "must be a finite number, got inf"),
    (["--rate", "nan"], "must be a finite number, got nan"),
    (["--rate", "-1"], "must be a positive number"),
    (["--seed", "-1"], "in [0, 2**32)"),
    (["--seed", "99999999999999999999"], "in [0, 2**32)"),
])
def test_numbers_are_finite_and_seeds_in_range(argv, fragment, capsys):
    from labkit.cli import positive_float

    parser = lab_parser("test", prog="lab.py")
    parser.add_argument("--rate", type=positive_float, default=1.0)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(argv)
    assert exc.value.code == 2 and fragment in capsys.readouterr().err
    assert parser.parse_args(["--seed", str(2**32 - 1)]).seed == 2**32 - 1


def test_run_lab_reports_out_of_memory_in_one_line(capsys):
    def cpu_oom(argv):
        torch.empty(1 << 62, dtype=torch.uint8)  # 4 EiB: the CPU allocator refuses

    with pytest.raises(SystemExit) as exc:
        run_lab(cpu_oom, [], prog="lab.py")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("lab.py: error: out of memory (") and err.rstrip().endswith("ask for smaller sizes")

    def other(argv):
        raise RuntimeError("a real bug")

    with pytest.raises(RuntimeError, match="a real bug"):  # anything else is not swallowed
        run_lab(other, [], prog="lab.py")


def test_progress_bar_is_silent_when_quiet(capsys):
    assert list(progress(range(3), total=3, quiet=True)) == [0, 1, 2]
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- provenance
def test_provenance_record_has_every_field():
    record = prov.collect("lab-02-single-gpu-training", "cpu", wall_time_s=1.23456)
    for key in ("device_type", "device_name", "driver_version", "cuda_version", "torch_version",
                "python_version", "git_commit", "source_hash", "labkit_hash", "date_utc", "wall_time_s"):
        assert key in record, key
    assert record["device_type"] == "cpu"
    assert record["torch_version"] == torch.__version__
    assert record["lab"] == "lab-02-single-gpu-training"
    assert len(record["source_hash"]) == 16
    assert record["wall_time_s"] == 1.235
    json.dumps(record)


def test_provenance_takes_the_commit_from_the_environment_without_git(monkeypatch):
    """A tree copied to a GPU machine has no .git: scripts/gpu_kit passes the commit along."""
    monkeypatch.setattr(prov, "_git", lambda *args: None)
    monkeypatch.delenv("INFRALAB_GIT_COMMIT", raising=False)
    assert prov.collect(None, "cpu")["git_commit"] is None
    monkeypatch.setenv("INFRALAB_GIT_COMMIT", "0123456789abcdef")
    monkeypatch.setenv("INFRALAB_GIT_DIRTY", "1")
    record = prov.collect(None, "cpu")
    assert record["git_commit"] == "0123456789abcdef" and record["git_dirty"] is True
    monkeypatch.setattr(prov, "_git", lambda *args: "fedcba" if args[0] == "rev-parse" else "")
    assert prov.collect(None, "cpu")["git_commit"] == "fedcba"  # git, where there is one, wins


def test_source_hash_follows_the_source(tmp_path):
    lab = tmp_path / "lab-99-demo"
    lab.mkdir()
    (lab / "a.py").write_text("x = 1\n")
    first = prov.source_hash(lab)
    assert prov.source_hash(lab) == first
    (lab / "a.py").write_text("x = 2\n")
    assert prov.source_hash(lab) != first


def test_write_results_is_json_with_provenance(tmp_path):
    record = prov.collect(None, "cpu")
    path = prov.write_results(tmp_path / "deep" / "r.json", {"value": 3}, record)
    data = json.loads(path.read_text())
    assert data["value"] == 3 and data["provenance"]["device_type"] == "cpu"
    assert not list(tmp_path.rglob("*.tmp"))


# ---------------------------------------------------------------- plots
def _small_timeline():
    ledger = Ledger("cpu")
    w = torch.ones(1000)
    ledger.track(w, "parameters")
    with ledger:
        for step in range(2):
            with ledger.phase("forward", step):
                a = w * 2
                b = a + 1
            with ledger.phase("backward", step):
                del a, b
    return ledger


def test_timeline_plot_writes_png_and_svg(tmp_path):
    ledger = _small_timeline()
    tl = ledger.timeline()
    fig = plot_timeline(tl, title="t", overlay={"prediction": [4000] * len(tl)})
    png = save(fig, tmp_path / "t.png")
    svg = save(fig, tmp_path / "t.svg")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text and "prediction" in text


def test_peak_table_has_a_row_per_phase_and_a_total():
    ledger = _small_timeline()
    table = peak_table(ledger.peaks_by_phase())
    lines = table.splitlines()
    assert lines[0].startswith("| phase | parameters |") and lines[0].endswith("| total |")
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["forward", "backward"]
    assert "**11.72 KiB**" in lines[2]  # 1000 params + two 1000-float temporaries, 4 B each


def test_decimate_keeps_every_local_peak():
    values = [0] * 10_000
    values[4321] = 7
    kept = decimate(values, 100)
    assert 4321 in kept and len(kept) <= 102
    assert decimate([1, 2, 3], 100) == [0, 1, 2]


def test_format_bytes():
    assert format_bytes(0) == "0"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(3 * 2**20, unit="KiB") == "3072.00 KiB"


# ---------------------------------------------------------------- toy models
@pytest.mark.parametrize("cfg", [GPTConfig(), GPTConfig(width=48, layers=3, heads=6, vocab=97, seq_len=20)])
def test_gpt_parameter_count_matches_its_formula(cfg):
    assert sum(p.numel() for p in TinyGPT(cfg).parameters()) == gpt_param_count(cfg)


def test_gpt_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(width=10, heads=3)
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=1.0)


def test_math_and_sdpa_attention_agree():
    torch.manual_seed(0)
    a = TinyGPT(GPTConfig(attention="sdpa")).eval()
    b = TinyGPT(GPTConfig(attention="math")).eval()
    b.load_state_dict(a.state_dict())
    x, y = SyntheticTokens(256, 64).batch(0, 2)
    torch.testing.assert_close(a(x, y)[0], b(x, y)[0], rtol=1e-5, atol=1e-5)


def test_synthetic_tokens_are_deterministic_and_shifted():
    data = SyntheticTokens(vocab=50, seq_len=12, seed=3)
    x1, y1 = data.batch(7, 4)
    x2, y2 = SyntheticTokens(vocab=50, seq_len=12, seed=3).batch(7, 4)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(x1, data.batch(8, 4)[0])
    follows_rule = (data.perm[x1] == y1).float().mean().item()
    assert follows_rule > 0.75  # 10 % of positions restart at a random token


def test_the_synthetic_task_is_learnable():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=32, seq_len=16, width=32, layers=1, heads=2)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = SyntheticTokens(cfg.vocab, cfg.seq_len)
    losses = []
    for step in range(40):
        x, y = data.batch(step, 16)
        loss = model(x, y)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_source_hash_covers_the_labs_a_lab_imports_from():
    from labkit.provenance import lab_dir, lab_folders

    names = [p.name for p in lab_folders(lab_dir("lab-09-activation-offload"))]
    assert names[0] == "lab-09-activation-offload" and "lab-04-activation-checkpointing" in names
    assert [p.name for p in lab_folders(lab_dir("lab-02-single-gpu-training"))] == ["lab-02-single-gpu-training"]
