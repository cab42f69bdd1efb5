"""labkit: the lab bench shared by every InfraLab lab.

labkit holds instruments, never lessons: device choice and the command-line pattern
(:mod:`labkit.cli`), the memory ledger (:mod:`labkit.ledger`), plots (:mod:`labkit.plot`),
provenance and results files (:mod:`labkit.provenance`), CUDA snapshot export
(:mod:`labkit.cuda`) and the toy models (:mod:`labkit.models`).

Names are imported lazily so that light users (the site build reads provenance) do not pay
for importing torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "UsageError": "labkit.cli",
    "lab_parser": "labkit.cli",
    "pick_device": "labkit.cli",
    "run_lab": "labkit.cli",
    "progress": "labkit.cli",
    "emit_json": "labkit.cli",
    "positive_int": "labkit.cli",
    "positive_float": "labkit.cli",
    "Ledger": "labkit.ledger",
    "CATEGORIES": "labkit.ledger",
    "source_hash": "labkit.provenance",
    "write_results": "labkit.provenance",
    "GPTConfig": "labkit.models",
    "TinyGPT": "labkit.models",
    "SyntheticTokens": "labkit.models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
