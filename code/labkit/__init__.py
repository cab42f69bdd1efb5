"""labkit: the lab bench shared by every InfraLab lab.

labkit holds instruments, never lessons. A lab imports what it needs by module:

* :mod:`labkit.marks` -- the ambient marks a lesson leaves in its code (``marks.phase``); free
  unless an instrument watches;
* :mod:`labkit.ledger` -- the memory ledger, a recorder of every allocation and free;
  :mod:`labkit.timeline` -- what it recorded, read without torch; :mod:`labkit.stacks` -- which
  line allocated what;
* :mod:`labkit.config` and :mod:`labkit.cli` -- one typed ``Config`` per lab and the command line
  built from it;
* :mod:`labkit.labs` -- ``labs.load(8)``: how labs reuse each other;
* :mod:`labkit.table`, :mod:`labkit.plot`, :mod:`labkit.notebook`, :mod:`labkit.provenance` -- one
  table renderer, one plotting path, the notebooks' first and last cell, where a number came from;
* :mod:`labkit.cuda`, :mod:`labkit.schedule`, :mod:`labkit.dist` -- CUDA snapshots and peaks,
  residency schedules, torchrun;
* :mod:`labkit.models`, :mod:`labkit.diffusion` -- the toy models the labs train and offload.

Names are imported lazily so that light users (the site build reads provenance and tables) do
not pay for importing torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "UsageError": "labkit.config",
    "LabConfig": "labkit.config",
    "option": "labkit.config",
    "Ledger": "labkit.ledger",
    "CATEGORIES": "labkit.timeline",
    "Timeline": "labkit.timeline",
    "Table": "labkit.table",
    "format_bytes": "labkit.table",
    "GPTConfig": "labkit.models",
    "TinyGPT": "labkit.models",
    "SyntheticTokens": "labkit.models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
