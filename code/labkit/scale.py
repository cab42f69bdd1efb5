"""The flags that take a lab from its toy model to a real one: ``--model`` and ``--fake``.

A lab whose ``Config`` mixes in :class:`RealScale` runs its own technique on a real architecture::

    .venv/bin/python code/lab-02-single-gpu-training/train_single_gpu.py --model llama-3-8b --fake --seq-len 4096 --batch-size 1

``--model`` names an entry of :mod:`labkit.zoo` (``llama-3-8b``, ``mixtral-8x7b``, ...) or a Hugging
Face ``config.json`` of a causal LM; the default, ``tiny``, is the lab's TinyGPT built from its shape
flags. ``--fake`` runs the step on fake tensors (:mod:`labkit.fake`): the ledger counts every byte
the real step would hold, rounded as the CUDA caching allocator rounds, and nothing is allocated,
so Llama-3-70B traces on a laptop. Without ``--fake`` a zoo model is built for real (a ``small-*``
entry runs on a CPU in seconds; a real-size one is refused by the lab's memory budget).

With ``--model``, the width, layers, heads and vocabulary are the zoo model's own; ``--seq-len``
and the batch size stay the lab's. A lab runs the families its step takes (:attr:`RealScale.FAMILIES`:
the causal language models, unless the lab says more); any other zoo name is refused in one line
that lists the ones it can run.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from labkit import fake
from labkit.config import UsageError, option

TINY = "tiny"


@dataclass
class RealScale:
    """Mix into a lab's ``Config`` (``class Config(RealScale, TinyGPTShape, LabConfig)``)."""

    #: the zoo families the lab's step runs: token in, logits and a loss out (a diffusion transformer
    #: takes latents, a text embedding and a timestep instead)
    FAMILIES: ClassVar[tuple[str, ...]] = ("llama", "mixtral", "gpt", "hf")

    model: str = option(TINY, "the model: 'tiny' (this lab's TinyGPT, from the shape flags), a zoo name "
                        "(llama-3-8b, llama-3-70b, mixtral-8x7b, ...) or a Hugging Face config.json",
                        metavar="NAME|PATH")
    fake: bool = option(False, "trace on fake tensors: every byte the step would hold is counted "
                        "(rounded like the CUDA allocator), nothing is allocated")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model != TINY:
            spec = self.model_spec()  # an unknown name or a bad path is refused now, in one line
            if spec.family not in self.FAMILIES:
                from labkit import zoo

                runs = [TINY, *(n for n in zoo.names() if zoo.get(n).family in self.FAMILIES)]
                raise UsageError(f"--model {self.model} is a {spec.family} model, which this lab does not run: "
                                 f"give one of {', '.join(runs)}" + (" or a Hugging Face config.json" if "hf" in
                                                                    self.FAMILIES else ""))
        if self.fake and getattr(self, "device", "cpu") == "cuda":
            raise UsageError("--fake traces on this machine's CPU dispatch; leave --device at cpu or auto")

    def model_spec(self):
        """The zoo entry (or Hugging Face config) ``--model`` names; None for ``tiny``."""
        if self.model == TINY:
            return None
        from labkit import zoo

        return zoo.get(self.model)

    def tensors(self) -> contextlib.AbstractContextManager:
        """Where the lab's run happens: ``fake.tensors()`` with ``--fake``, else nothing special."""
        return fake.tensors() if self.fake else contextlib.nullcontext()

    def build_model(self, tiny, dtype: torch.dtype | None = None) -> nn.Module:
        """The model to run: ``tiny()`` for ``--model tiny``, else the zoo's, on fake or real tensors.

        ``tiny``: a function that builds the lab's own TinyGPT (called as before, real or fake).
        ``dtype``: cast the model's floating-point weights to it (the lab's TinyGPT as a zoo model).
        """
        build = tiny if self.model_spec() is None else self.model_spec().build
        if self.fake:
            return fake.materialize(build, dtype=dtype)
        model = build()
        return model.to(dtype) if dtype is not None else model
