"""Lab 13 - a fine-tune's step (``--method lora|qlora``, ``--optimizer adamw8bit``): Lab 15's techniques
on the real model ``fit.py`` builds.

    --method        lora: adapters on a frozen base; qlora: the blocks' linears in NF4 too (Lab 15's
                    ``prepare``), with --lora-rank, --lora-targets and --lora-dropout
    --optimizer     adamw8bit: Lab 15's 8-bit AdamW, its moments as 8-bit codes in blocks of 2,048

Under LoRA the base is built in Lab 15's dtype for it (bf16, as PEFT loads it), the adapters in the
trained weights' dtype; the optimizer sees the adapters alone (``fit.shard`` passes it the parameters
that need a gradient). ``fit_setup.label`` names the frozen weights and the quantization constants.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit import labs
from labkit.config import UsageError, option

lab15 = labs.load(15)  # prepare, weights_dtype, AdamW8bit: LoRA, QLoRA's NF4 base, 8-bit AdamW
AdamW8bit = lab15.AdamW8bit


def base_dtype(config, weights: torch.dtype) -> torch.dtype:
    """The dtype the model is built in: ``weights`` (Lab 13's for --precision) when every weight trains,
    the frozen base's (Lab 15's) under LoRA."""
    return weights if config.method == "full" else lab15.weights_dtype(config.method, config.precision)


def adapt(model, config) -> None:
    """Lab 15's ``prepare``: adapters on the frozen base (NF4 under qlora); nothing under --method full."""
    lab15.prepare(model, config.method, config.precision, config.lora_rank, config.lora_targets,
                  dropout=config.lora_dropout)


@dataclass
class Adapters:
    """The flag a fine-tune adds to Lab 01's ``FineTuning`` (--method, --lora-rank, --lora-targets) in Lab 13."""

    lora_dropout: float = option(0.0, "--method lora or qlora: dropout on each adapter's input (PEFT's lora_dropout)",
                                 min=0, below=1)

    def check_adapters(self) -> None:
        """The rules of --method for ``fit.py`` (Lab 01's, and those of a step without backward)."""
        self.check_fine_tuning(self.spec)
        if self.method != "full" and self.task != "train":
            raise UsageError(f"--method {self.method} trains adapters: --task {self.task} has no training step")
        if self.lora_dropout and self.method == "full":
            raise UsageError("--lora-dropout drops an adapter's input: it needs --method lora or qlora")
