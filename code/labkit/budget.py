"""Refuse a run the machine cannot hold, before anything is allocated.

A size that fits a 64-bit integer can still be far beyond the machine: ``--width 1000000`` asks a
toy GPT for trillions of parameters. Left alone, such a run thrashes until it is killed or fails
deep inside torch. Each lab instead states, from its own formulas, a *floor*: bytes its run cannot
do without. :func:`require` compares it with what the device has free now (host RAM from
``/proc/meminfo``'s ``MemAvailable``; a GPU's free memory from ``torch.cuda.mem_get_info``) and
refuses in one line, naming both, when even the floor does not fit. A floor, not an estimate: a
run refused here could never have run, and a run that passes may still not fit (then the
allocator says so, and :func:`labkit.cli.main` reports that in one line too).
"""

from __future__ import annotations

import os

from labkit.config import UsageError
from labkit.table import format_bytes


def available(device) -> tuple[int, str]:
    """Bytes free for a run on ``device`` now, and where that figure comes from."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free), "free on the GPU (torch.cuda.mem_get_info)"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available RAM (MemAvailable)"
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical RAM"


def require(nbytes: int, device, what: str) -> None:
    """UsageError unless ``nbytes`` (a floor the caller derived, ``what`` says how) fits ``device``."""
    free, where = available(device)
    if nbytes > free:
        raise UsageError(f"this run needs at least {format_bytes(nbytes)} ({what}), but the machine has "
                         f"{format_bytes(free)} {where}: ask for smaller sizes")


def require_gpt_training(model_config, batch: int, device, dp: int = 1) -> None:
    """The floor of an fp32 AdamW step of ``labkit.models.TinyGPT``: the parameters and AdamW's two
    moments (12 B per parameter, sharded over ``dp`` ranks at most) and the logits of one
    micro-batch (4 B x batch x seq x vocab), all alive at once in every step after the first."""
    from labkit.models import gpt_param_count

    params = gpt_param_count(model_config)
    floor = 12 * params // max(dp, 1) + 4 * batch * model_config.seq_len * model_config.vocab
    require(floor, device, f"12 B x {params:,} parameters / {dp} rank(s) + 4 B x {batch} x "
                           f"{model_config.seq_len} tokens x {model_config.vocab} logits")
