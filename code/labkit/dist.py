"""What the torchrun labs (10 and 11) share: joining the process group, one voice for errors,
and checks that fail loudly.

Instrument, not lesson:

* ``start(script, device, backend)`` reads what torchrun sets (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), puts the rank on its GPU and joins the process group.
  ``auto`` is NCCL with one GPU per rank, gloo otherwise: on CPU, and when ranks share a GPU,
  which NCCL does not support; gloo then stages the CUDA tensors through host memory.
* ``ranked(main)`` wraps a lab's ``main``: rank 0 alone reports bad input (one line, exit 2) or a
  failed check (one line, exit 1); the other ranks exit with the same code in silence; every rank
  leaves the process group.
* ``CheckFailed`` is what a lab raises when a result breaks the tolerance it states.
* ``writable_dir`` refuses an output folder that cannot be written, before any training.
* ``world_of_one`` is the environment torchrun would give a single rank: a lab's ``main`` then runs
  in the calling process (the tests use it).
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.cli import UsageError, _prog, pick_device
from labkit.cuda import warm_up


#: seconds a silent rank waits before it exits 2: torchrun stops every rank once one has failed,
#: and rank 0 must have printed its line by then
QUIET_EXIT_DELAY_S = 2.0


class CheckFailed(Exception):
    """A result broke the tolerance its lab states. Not bad input: ``ranked`` exits with 1, not 2."""


def start(script: str, device_name: str, backend: str = "auto") -> tuple[torch.device, str]:
    """Join the process group torchrun prepared; returns this rank's device and the backend."""
    device = pick_device(device_name)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UsageError(f"RANK and WORLD_SIZE are not set: launch with torchrun, e.g. "
                         f"torchrun --nproc_per_node=2 {script} --device {device.type}")
    local, per_node = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if backend == "auto":
        backend = "nccl" if gpus >= per_node > 0 else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UsageError("--backend nccl needs --device cuda (NCCL only moves GPU memory)")
    if backend == "nccl" and gpus < per_node:
        raise UsageError(f"NCCL needs one GPU per rank: {per_node} ranks on this node, {gpus} GPU(s) "
                         f"(use --backend auto: ranks that share a GPU talk through gloo)")
    if device.type == "cuda":
        device = torch.device("cuda", local % gpus)  # ranks beyond the GPU count share them
        torch.cuda.set_device(device)
        warm_up(device)  # this rank's GPU: cuBLAS workspaces taken before anything is measured
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return device, backend


def ranked(main):
    """Run a lab's ``main`` on every rank with one voice: rank 0's.

    Rank 0 reports bad input (a ``UsageError``: one line, exit 2, via ``run_lab``) and a failed
    check (a ``CheckFailed``: one line, exit 1). A failed check is not bad input, so it does not
    share exit code 2: the command was right and the result is wrong. The other ranks exit with the
    same code without a word, bad input a moment later than rank 0 (``QUIET_EXIT_DELAY_S``). A real
    error still surfaces on every rank, with what it had printed. Every rank leaves the process
    group at the end.
    """
    def wrapped(argv=None):
        quiet = int(os.environ.get("RANK", "0")) != 0
        buf = io.StringIO()
        try:
            with contextlib.redirect_stderr(buf) if quiet else contextlib.nullcontext():
                return main(argv)
        except UsageError:
            if quiet:
                time.sleep(QUIET_EXIT_DELAY_S)
                raise SystemExit(2) from None
            raise
        except CheckFailed as err:
            if not quiet:
                print(f"{_prog(None)}: check failed: {err}", file=sys.stderr)
            raise SystemExit(1) from None
        except SystemExit as err:
            if quiet and err.code == 2:
                time.sleep(QUIET_EXIT_DELAY_S)
                raise SystemExit(2) from None
            raise
        except BaseException:
            print(buf.getvalue(), end="", file=sys.stderr)
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return wrapped


def writable_dir(path: Path, flag: str) -> Path:
    """``path`` as a folder this process can write into (created if needed), or a UsageError."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise UsageError(f"{flag} {path}: cannot write there ({err.strerror or err})") from None
    return path


def world_of_one() -> dict[str, str]:
    """The variables torchrun sets for a world of one rank, with a free port for the rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
