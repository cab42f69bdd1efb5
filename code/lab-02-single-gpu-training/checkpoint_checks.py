"""Lab 02's checkpoint, read defensively: every field checked before any of it is used.

A checkpoint is a file from outside the run: a truncated copy, a tampered file, one written by
another run. :func:`read_checkpoint` turns each way it can be wrong into one line (a
:class:`UsageError`, exit code 2) before anything is loaded:

* ``torch.load(..., weights_only=True)`` (:func:`labkit.files.load_checked`) unpickles tensors and
  plain containers only, and every entry's content hash is checked: tensors, and the plain values
  beside them (a learning rate, the step count);
* the format, the settings the run was saved with (model, learning rate, seed, batch size, ...), and
  the step (a whole number);
* the optimizer's state, field by field, against what this run's optimizer would have written: the
  same groups with the same hyper-parameters (an ``lr`` of 0.5 where the settings say 0.003, an
  ``amsgrad`` switched on), each parameter's AdamW moments with its shape and dtype, and a step
  count equal to the checkpoint's step;
* the RNG states' types and sizes.

:func:`resume` loads it, and turns what ``load_state_dict`` still refuses into one line too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from labkit import files
from labkit.config import UsageError

FORMAT = "infralab/lab-02/v1"
#: what AdamW keeps per parameter (``amsgrad`` would add ``max_exp_avg_sq``: this lab's groups refuse it)
ADAMW_STATE = {"step", "exp_avg", "exp_avg_sq"}


def read_checkpoint(path: Path, settings: dict, model=None, optimizer=None) -> dict:
    """The checkpoint at ``path``, or a UsageError that says in one line what is wrong with it: a
    missing, corrupt (every entry's content hash is checked), foreign or incomplete file, one saved
    with other settings (another model, learning rate, seed, batch size or zero_grad mode: resuming
    would not be exact), or a field that this run's ``model`` and ``optimizer`` would not have
    written (see the module's text)."""
    if not path.is_file():
        raise UsageError(f"checkpoint not found: {path}")
    try:
        state = files.load_checked(path)  # weights_only=True: loading cannot run code
    except Exception as err:  # a truncated, tampered or foreign file fails in many ways
        why = reason(err)
        if "Weights only load failed" in why:
            why = "not a weights-only PyTorch checkpoint (corrupt, truncated, pickled)"
        raise UsageError(f"cannot read checkpoint {path}: {why}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"{path} is not a Lab 02 checkpoint")
    if missing := [k for k in ("settings", "step", "model", "optimizer", "rng") if k not in state]:
        raise UsageError(f"checkpoint {path} is incomplete: no {', '.join(missing)}")
    if (saved := state["settings"]) != settings:
        diff = [f"{k} {v} (file) vs {settings.get(k)} (now)" for k, v in saved.items()
                if settings.get(k) != v] if isinstance(saved, dict) else [f"{saved!r:.40}"]
        raise UsageError(f"checkpoint {path} was saved with other settings, resuming would not be exact: "
                         f"{', '.join(diff)}")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**53:
        raise UsageError(f"checkpoint {path} holds an impossible step: {step!r:.40}")
    if unknown := set(state) - {"format", "settings", "step", "model", "optimizer", "rng"}:
        raise UsageError(f"checkpoint {path} holds entries no Lab 02 run writes: {', '.join(map(str, unknown))}")
    if model is not None and optimizer is not None:
        try:
            check_model(state["model"], model)
            check_optimizer(state["optimizer"], optimizer, model, step)
            check_rng(state["rng"])
        except UsageError as err:
            raise UsageError(f"checkpoint {path} does not fit this run: {err}") from None
    return state


def check_model(saved, model) -> None:
    """The same parameter and buffer names as ``model``'s, each with its shape and dtype."""
    expected = model.state_dict()
    if not isinstance(saved, dict) or set(saved) != set(expected):
        names = set(saved) if isinstance(saved, dict) else set()
        raise UsageError(f"model entries differ (missing {sorted(set(expected) - names)[:3]}, "
                         f"unexpected {sorted(map(str, names - set(expected)))[:3]})")
    for name, want in expected.items():
        _tensor_like(saved[name], want.shape, want.dtype, f"model {name}")


def check_optimizer(saved, optimizer, model, step: int) -> None:
    """``saved`` as this run's ``optimizer`` would have written it after ``step`` steps."""
    fresh = optimizer.state_dict()  # this run's groups and hyper-parameters, no state yet
    if not isinstance(saved, dict) or set(saved) != {"state", "param_groups"}:
        raise UsageError(f"the optimizer entry is not an optimizer's state ({_short(saved)})")
    groups = saved["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(fresh["param_groups"]):
        raise UsageError(f"{_count(groups)} optimizer group(s), this run has {len(fresh['param_groups'])}")
    for i, (group, want) in enumerate(zip(groups, fresh["param_groups"])):
        if not isinstance(group, dict) or set(group) != set(want):
            raise UsageError(f"optimizer group {i} has other fields ({_short(group)})")
        for key, value in want.items():  # lr, betas, eps, weight_decay, amsgrad, foreach, fused, params ...
            if type(group[key]) is not type(value) or group[key] != value:
                raise UsageError(f"optimizer {key} {_short(group[key])} (file) vs {_short(value)} (this run)")
    params = dict(zip((i for g in fresh["param_groups"] for i in g["params"]), model.parameters()))
    per = saved["state"]
    if not isinstance(per, dict) or set(per) != (set(params) if step else set()):
        raise UsageError(f"optimizer state for {_count(per)} parameter(s), after step {step} this run has "
                         f"{len(params) if step else 0}")
    for i, entry in per.items():
        if not isinstance(entry, dict) or set(entry) != ADAMW_STATE:
            raise UsageError(f"optimizer state of parameter {i} is not AdamW's ({_short(entry)})")
        for key in ("exp_avg", "exp_avg_sq"):
            _tensor_like(entry[key], params[i].shape, params[i].dtype, f"optimizer {key} of parameter {i}")
        counter = entry["step"]
        if not isinstance(counter, torch.Tensor) or counter.numel() != 1 or not counter.is_floating_point() \
                or counter.item() != step:
            raise UsageError(f"optimizer step count of parameter {i} is {_short(counter)}, the checkpoint's step {step}")


def check_rng(saved) -> None:
    """The CPU generator's state (a uint8 tensor of its size) and a list of CUDA ones."""
    cpu = torch.get_rng_state()
    if not isinstance(saved, dict) or set(saved) != {"cpu", "cuda"} or not isinstance(saved["cuda"], list):
        raise UsageError(f"the RNG entry is not a generator state ({_short(saved)})")
    _tensor_like(saved["cpu"], cpu.shape, cpu.dtype, "rng cpu")
    for i, state in enumerate(saved["cuda"]):
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
            raise UsageError(f"rng cuda {i} is not a generator state ({_short(state)})")


def _tensor_like(value, shape, dtype, what: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise UsageError(f"{what} is not a tensor ({_short(value)})")
    if value.shape != shape or value.dtype != dtype:
        raise UsageError(f"{what} is {value.dtype} {tuple(value.shape)}, this run's {dtype} {tuple(shape)}")


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor {tuple(value.shape)}" if value.numel() != 1 else f"{value.item()!r}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _count(value) -> str:
    return str(len(value)) if isinstance(value, (list, dict)) else _short(value)


def resume(path: Path, load, model, optimizer, settings: dict) -> int:
    """``load(path, model, optimizer, settings)`` (the lab's ``load_checkpoint``), with every way a
    damaged checkpoint still fails to load turned into one line: a tensor of the wrong shape, a bad
    RNG state."""
    try:
        return load(path, model, optimizer, settings)
    except UsageError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as err:
        raise UsageError(f"checkpoint {path} does not fit this run: {reason(err)}") from None


def reason(err: Exception) -> str:
    """An exception's message on one line (PyTorch's state_dict errors span several)."""
    if isinstance(err, KeyError):
        return f"no entry {err}"
    return " ".join(str(err).split())[:200] or type(err).__name__
