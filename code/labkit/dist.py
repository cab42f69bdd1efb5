"""What the torchrun labs (10 and 11) share: joining the process group, one voice for errors,
checks that fail loudly, and torchrun launched from a notebook or a test.

Instrument, not lesson. A torchrun lab ends like every other lab, inside one voice::

    if __name__ == "__main__":
        with dist.one_voice() as voice:
            cli.main(Config, voice.ranked(run), report)

* Every rank makes the ``Config`` from the same flags, so every rank refuses bad input there,
  before any process group exists. :func:`check_backend` is the backend rule a ``Config`` applies.
* ``run(config)`` joins the process group for a block, ``with dist.joined(config.device,
  config.backend) as (device, backend):``. :func:`joined` reads what torchrun sets (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), puts the rank on its GPU and joins; it
  launches no GPU work (a :class:`labkit.ledger.Ledger` warms the GPU up when a measurement
  begins). At the end of the block the ranks wait for each other and leave the group. ``run``
  returns rank 0's result, and None on the other ranks.
* :func:`one_voice`: rank 0 alone reports bad input (one line, exit 2) and a broken promise (one
  line, exit 1); the other ranks exit with the same code in silence. ``voice.ranked(run)`` is the
  ``run`` that ``cli.main`` calls: once ``run`` returns, the other ranks leave (rank 0 reports for
  them), and a :class:`CheckFailed` that carries its result is raised after ``cli.main`` has
  reported that result, so the numbers that broke a promise are on screen above the line that
  says so.
* :func:`writable_dir` refuses an output folder that cannot be written, before any training.
* :func:`torchrun` starts a torchrun lab in other processes; :func:`launch` runs one from a
  notebook or a test: every ``Config`` at once (its flags from :func:`labkit.cli.argv`), rank 0's
  JSON summary of each.
* :func:`world_of_one` is the environment torchrun would give a single rank: a lab's command line
  then runs in the calling process (the tests use it).
* :class:`Ranks` (mixed into a torchrun lab's ``Config``) and :func:`start_ranks`: run with plain
  ``python``, a torchrun lab checks its flags in this one process and then starts its ranks itself
  (PyTorch's elastic launcher, the engine inside torchrun). Bad input is then one line and exit 2
  before any rank exists, and a rank that fails ends the job with one line naming it, instead of
  torchrun's page of report. Launched with torchrun, the same script runs as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import gc
import inspect
import io
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from labkit import cli
from labkit.cli import UsageError, _prog, pick_device
from labkit.config import option

CODE_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = CODE_DIR.parent

#: seconds a silent rank waits before it exits 2: torchrun stops every rank once one has failed,
#: and rank 0 must have printed its line by then
QUIET_EXIT_DELAY_S = 2.0

#: what torchrun sets in each rank's environment; a launch from a process that has them (a test
#: inside ``world_of_one``) must not pass them on
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class CheckFailed(Exception):
    """A result broke the tolerance its lab states. Not bad input: the exit code is 1, not 2.

    ``result``: the result that broke it. Raised from a ``run`` wrapped by ``voice.ranked``, it is
    held until ``cli.main`` has reported that result; without one it is reported at once."""

    def __init__(self, message: str, result=None) -> None:
        super().__init__(message)
        self.result = result


# ---------------------------------------------------------------------- starting the ranks
#: ranks a plain ``python`` run starts when ``--nproc-per-node`` is not given
DEFAULT_RANKS = 2
#: the most ranks one command starts on one machine (each is a Python process with PyTorch loaded)
MAX_RANKS = 64


@dataclasses.dataclass
class Ranks:
    """Mix into a torchrun lab's ``Config`` (``class Config(Ranks, RealScale, ..., LabConfig)``):
    the ``--nproc-per-node`` flag, and whether this process starts the ranks or is one of them."""

    nproc_per_node: int | None = option(
        None, f"run with python: the ranks this command starts (default {DEFAULT_RANKS}); under torchrun: "
        "the ranks torchrun started on this node (its flag of the same name)", min=1, max=MAX_RANKS)

    def __post_init__(self) -> None:
        super().__post_init__()
        started = os.environ.get("LOCAL_WORLD_SIZE")
        if started is not None and self.nproc_per_node is not None and self.nproc_per_node != int(started):
            raise UsageError(f"--nproc-per-node {self.nproc_per_node}, but torchrun started {started} rank(s) "
                             f"on this node: give the same number to both, or run the lab with python alone")

    def starts_ranks(self) -> bool:
        """True in the process the user ran with ``python``: it starts the ranks; under torchrun
        (``RANK`` is set) this process is a rank."""
        return "RANK" not in os.environ


def start_ranks(script: str | os.PathLike, argv: list[str], nproc_per_node: int = DEFAULT_RANKS,
                prog: str | None = None) -> int:
    """Run ``script argv`` as ``nproc_per_node`` ranks on this machine, as ``torchrun --standalone``
    would (PyTorch's elastic launcher, in this process), and return the exit code for the job.

    The ranks write to this terminal. Every rank refuses bad input before it joins the group, and
    rank 0 alone says so (:func:`one_voice`): the job then exits 2 without a word more. A rank
    refused mid-run by what it alone met (its ledger on a full disk) leaves its line to this
    process, which prints it: one line, exit 2. A rank that fails otherwise (an error, a signal)
    stops the others within a fraction of a second, and a rank that stays stopped (SIGSTOP, a
    debugger) for ``STOPPED_LIMIT_S`` is killed (:class:`StoppedRankWatch`: its peers would wait for
    it a minute and more); this process then prints one line naming it and returns 1 (a rank's own
    error is printed above, by that rank; the ranks that only lost it say nothing). A signal to this
    process stops the ranks too (exit 128 + its number). The launcher's logging is silenced below
    CRITICAL.
    """
    try:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    except ImportError as err:  # an API of PyTorch's launcher, public but worth a clear message
        raise UsageError(f"this PyTorch cannot start ranks itself ({err}); launch with "
                         f"torchrun --nproc_per_node={nproc_per_node} {os.path.relpath(script)}") from None
    import uuid

    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:  # each sets its own level
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc_per_node, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it: ranks share the cores
    # a rank that loses its peers leaves the report to this process; one refused mid-run leaves its line here
    os.environ[STARTED_BY_LABKIT] = said = tempfile.mkdtemp(prefix="labkit-ranks-")
    watch = StoppedRankWatch()
    watch.start()
    try:
        elastic_launch(config, sys.executable)("-u", str(script), *argv)
    except SignalException as sig:  # Ctrl-C or a kill of this process: the launcher stopped the ranks
        if sig.sigval != signal.SIGINT:  # after Ctrl-C, rank 0 has said "interrupted"
            print(f"{_prog(prog)}: stopped by {signal.Signals(sig.sigval).name}; so were the ranks", file=sys.stderr)
        return 128 + sig.sigval
    except ChildFailedError as failed:
        codes = {rank: f.exitcode for rank, f in failed.failures.items()}
        if watch.stopped is not None:
            rank, seconds = watch.stopped
            print(f"{_prog(prog)}: error: rank {rank} was stopped (SIGSTOP, or a debugger) for {seconds:.0f} s while "
                  f"the others waited for it; it was killed and the other ranks were stopped", file=sys.stderr)
            return 1
        if 2 in codes.values():  # bad input: rank 0 has said what; mid-run, maybe another rank alone
            if codes.get(0) != 2 and (lines := sorted(Path(said).glob("rank*.txt"), key=lambda p: int(p.stem[4:]))):
                print(lines[0].read_text(encoding="utf-8").strip(), file=sys.stderr)
            return 2
        if cli.STOPPED_READING in codes.values():
            return cli.STOPPED_READING  # the reader closed rank 0's output early: nothing to report
        # the news first: a rank killed by a signal (not the launcher's SIGTERM to the rest), then one that
        # failed, before the ranks that lost it (exit 1, silent) or that the launcher stopped
        rank, first = min(failed.failures.items(), key=lambda kv: (
            kv[1].exitcode == -signal.SIGTERM, kv[1].exitcode >= 0, kv[1].timestamp, kv[0]))
        how = (f"was killed by {first.signal_name()}" if first.exitcode < 0
               else f"exited with code {first.exitcode} (its error is above)")
        print(f"{_prog(prog)}: error: rank {rank} {how}; the other ranks were stopped", file=sys.stderr)
        return 1
    finally:
        watch.done()
        os.environ.pop(STARTED_BY_LABKIT, None)
        shutil.rmtree(said, ignore_errors=True)
    return 0


#: set in the ranks :func:`start_ranks` starts, to a folder: a rank that lost its peers says nothing, and one
#: refused mid-run (a full disk) leaves its line there; the launcher says one line for the job
STARTED_BY_LABKIT = "LABKIT_STARTED_RANKS"
#: seconds a started rank may stay stopped (SIGSTOP, a debugger's stop) before the job ends: its peers
#: would otherwise wait for it until the collective's time-out (a minute), then the launcher's grace (30 s)
STOPPED_LIMIT_S = 3.0


class StoppedRankWatch(threading.Thread):
    """Watches the ranks this process started (its child processes, in ``/proc``) and kills one that
    has been stopped for ``STOPPED_LIMIT_S`` (state ``T`` or ``t``): the launcher then stops the
    others and :func:`start_ranks` names it. A stopped process cannot send a heartbeat; its state
    says it all. If this process was itself stopped meanwhile (Ctrl-Z stops the whole job), the
    watch starts over. ``stopped``: ``(rank, seconds)`` once it has acted. Linux only (no ``/proc``:
    it does nothing, and the collective's time-out ends the job)."""

    def __init__(self, interval_s: float = 0.25) -> None:
        super().__init__(daemon=True, name="stopped-rank-watch")
        self.interval_s, self.stopped = interval_s, None
        self._done = threading.Event()

    def done(self) -> None:
        self._done.set()

    def run(self) -> None:
        since: dict[int, float] = {}
        last = time.monotonic()
        while not self._done.wait(self.interval_s) and os.path.isdir("/proc"):
            now = time.monotonic()
            if now - last > 4 * self.interval_s:
                since.clear()  # this process did not run for a while: stopped with its ranks, or starved
            last = now
            states = dict(_children())
            since = {pid: since.get(pid, now) for pid, state in states.items() if state in "Tt"}
            for pid, first in since.items():
                if now - first >= STOPPED_LIMIT_S:
                    self.stopped = (_rank_of(pid), now - first)
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                    return


def _children() -> Iterator[tuple[int, str]]:
    """(pid, state) of this process's children, from ``/proc/PID/stat``."""
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (command name)"
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and fields[1] == str(me):
            yield int(name), fields[0]


def _rank_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        return env.get(b"RANK", b"?").decode()
    except OSError:
        return f"(pid {pid})"


# ---------------------------------------------------------------------- joining the process group
def check_backend(device: torch.device, backend: str) -> None:
    """The rule a ``Config`` applies before anything runs: NCCL moves GPU memory only."""
    if backend == "nccl" and device.type != "cuda":
        raise UsageError("--backend nccl needs --device cuda (NCCL only moves GPU memory)")


@contextlib.contextmanager
def joined(device: str = "auto", backend: str = "auto", timeout_s: float = 60) -> Iterator[tuple[torch.device, str]]:
    """This process in the group torchrun prepared, for the block: yields its device and the backend.

    ``device``: ``auto``, ``cpu`` or ``cuda``; rank r on a node uses GPU ``r mod GPUs``.
    ``timeout_s``: how long a collective waits for a rank that does not come (a rank that froze or
    died) before it fails, and the job with it; PyTorch's default is 30 minutes, far beyond a lab.
    The rank also ends when its launcher dies (Linux: ``PR_SET_PDEATHSIG``), so killing torchrun
    leaves no orphans.
    ``backend``: ``auto`` is NCCL with one GPU per rank, gloo otherwise: on CPU, and when ranks
    share a GPU, which NCCL does not support (gloo then stages the CUDA tensors through host
    memory). A process torchrun did not start, and NCCL without a GPU per rank, are refused
    (``UsageError``) before joining. At the end of the block every rank waits for the others
    (gloo aborts a process whose peer has already gone), then leaves; after an error it leaves at
    once. Before the wait, unreachable objects are collected: a finished model that holds the
    group goes while the group is alive (see :func:`one_voice`).
    """
    this_device, backend = _join(device, backend, timeout_s)
    try:
        yield this_device, backend
        gc.collect()  # what the block left that holds the group (a DDP, a sharded model) goes first
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _join(device_name: str, backend: str, timeout_s: float = 60) -> tuple[torch.device, str]:
    device = pick_device(device_name)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else "LAB.py"
        raise UsageError(f"RANK and WORLD_SIZE are not set: launch with torchrun, e.g. "
                         f"torchrun --nproc_per_node=2 {script} --device {device.type}")
    check_backend(device, backend)
    local, per_node = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if backend == "auto":
        backend = "nccl" if gpus >= per_node > 0 else "gloo"
    if backend == "nccl" and gpus < per_node:
        raise UsageError(f"NCCL needs one GPU per rank: {per_node} ranks on this node, {gpus} GPU(s) "
                         f"(use --backend auto: ranks that share a GPU talk through gloo)")
    if device.type == "cuda":
        device = torch.device("cuda", local % gpus)  # ranks beyond the GPU count share them
        torch.cuda.set_device(device)
    _end_with_the_launcher()
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    global _joined
    _joined = True
    return device, backend


_joined = False  # this process has joined a group: from then on, a rank may meet what its peers do not


def peer_lost(err: BaseException) -> bool:
    """A collective failed because another rank is gone or silent: its connection closed, reset or
    timed out (gloo and NCCL raise ``DistError`` or a RuntimeError that says so)."""
    signs = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out", "timed out",
             "NCCL communicator was aborted", "Socket Timeout")
    return isinstance(err, RuntimeError) and (isinstance(err, getattr(dist, "DistError", ())) or
                                              any(sign in str(err) for sign in signs))


def _end_with_the_launcher() -> None:
    """Ask Linux to send this rank SIGTERM when its parent (torchrun's agent) dies. Elsewhere:
    nothing (the process-group timeout still ends a job whose peer is gone)."""
    if sys.platform != "linux":
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------- one voice
class Voice:
    """Rank 0 speaks for every rank; made by :func:`one_voice`, entered around ``cli.main``."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.held: CheckFailed | None = None
        self._silence = contextlib.ExitStack()
        self._unsaid = io.StringIO()

    @property
    def speaks(self) -> bool:
        return self.rank == 0

    def ranked(self, run):
        """``run(config)`` as ``cli.main`` should call it on every rank: rank 0 gets the result to
        report; the other ranks leave once ``run`` returns; a ``CheckFailed`` carrying a result
        is held until the result has been reported."""
        @functools.wraps(run)
        def run_on_every_rank(config):
            if isinstance(config, Ranks) and config.starts_ranks():  # run with python: start the ranks
                flags = [*cli.argv(config), *(["--json"] if cli.answers_in_json() else [])]
                raise SystemExit(start_ranks(inspect.getfile(run), flags, config.nproc_per_node or DEFAULT_RANKS))
            try:
                result = run(config)
            except CheckFailed as failed:
                if failed.result is None:
                    raise
                self.held, result = failed, failed.result
            if not self.speaks:
                raise SystemExit(0)  # rank 0 reports for every rank
            return result
        return run_on_every_rank

    def __enter__(self) -> Voice:
        if not self.speaks:
            self._silence.enter_context(contextlib.redirect_stderr(self._unsaid))
        return self

    def __exit__(self, kind, err, traceback) -> bool:
        self._silence.close()
        gc.collect()  # see one_voice: nothing that holds a process group may outlive Python
        if dist.is_initialized():
            dist.destroy_process_group()
        if err is None and self.held is not None:
            err = self.held
        if isinstance(err, CheckFailed):
            if self.speaks:
                print(f"{_prog(None)}: check failed: {err}", file=sys.stderr)
            raise SystemExit(1) from None
        if isinstance(err, SystemExit) and err.code == 2 and not self.speaks:
            if _joined:  # refused mid-run, maybe by this rank alone (its disk is full): it says why
                self._say_through_the_launcher()
            else:
                time.sleep(QUIET_EXIT_DELAY_S)  # bad input: rank 0 says so, then torchrun stops the rest
        elif err is not None and peer_lost(err):  # another rank failed or froze: that one is the news
            if not os.environ.get(STARTED_BY_LABKIT):  # under torchrun, one line; start_ranks names the rank
                print(f"{_prog(None)}: error: rank {self.rank} lost contact with the other ranks "
                      f"({' '.join(str(err).split())[:160]})", file=sys.stderr)
            raise SystemExit(1) from None
        elif err is not None and not isinstance(err, (SystemExit, KeyboardInterrupt)) and not self.speaks:
            print(self._unsaid.getvalue(), end="", file=sys.stderr)  # a real error: all it printed
        return False


    def _say_through_the_launcher(self) -> None:
        """This rank's line, for :func:`start_ranks` to print (one line for the job), or on stderr."""
        folder, line = os.environ.get(STARTED_BY_LABKIT), self._unsaid.getvalue()
        if folder:
            with contextlib.suppress(OSError):
                Path(folder, f"rank{self.rank}.txt").write_text(line, encoding="utf-8")
                return
        print(line, end="", file=sys.stderr)


def one_voice() -> Voice:
    """Rank 0 alone speaks: bad input (exit 2) and a broken promise (exit 1) are one line from
    rank 0, and the other ranks exit with the same code without a word (bad input a moment later
    than rank 0, ``QUIET_EXIT_DELAY_S``). Once the group is joined, a rank may meet alone what its
    peers do not (a full disk): it says so itself (through :func:`start_ranks` when that started
    it). A collective that fails because a peer is gone (:func:`peer_lost`) is one line under
    torchrun and silence under :func:`start_ranks`, which names the rank that went; exit 1. A real
    error surfaces on every rank, with what it had printed. Every rank leaves the process group at
    the end.

    Every object ``run`` left that holds a process group (a DDP module, an FSDP-sharded model, a
    ``ZeroRedundancyOptimizer``) is collected on the way out, while Python is still alive. Left to
    the interpreter's shutdown, such an object keeps gloo's worker threads alive past it, and the
    process may abort (``terminate called without an active exception``, SIGABRT) after a run
    that succeeded."""
    return Voice()


def writable_dir(path: Path, flag_name: str) -> Path:
    """``path`` as a folder this process can write into (created if needed), or a UsageError."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise UsageError(f"{flag_name} {path}: cannot write there ({err.strerror or err})") from None
    return path


# ---------------------------------------------------------------------- launching torchrun
def torchrun(lab, argv: list[str], nproc_per_node: int = 2) -> subprocess.Popen:
    """Start ``lab`` (its module, or its file) under torchrun with ``argv``, from the repository
    root, with this labkit; returns the running launcher (text pipes for stdout and stderr).

    ``nproc_per_node``: how many ranks. One thread per rank unless ``OMP_NUM_THREADS`` says more.
    """
    script = Path(getattr(lab, "__file__", lab))
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CODE_DIR), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc_per_node}",
               str(script), *argv]
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def launch(lab, configs: Mapping[str, object], nproc_per_node: int = 2, timeout: float = 900) -> dict[str, dict]:
    """Run ``lab`` under torchrun once per config, all at once (a launch is mostly process
    start-up), and return the one JSON object rank 0 printed for each (``--json``).

    ``lab``: the lab's module (or its file); ``configs``: name -> the lab's ``Config``;
    ``nproc_per_node``: ranks per launch; ``timeout``: seconds to wait for each. A launch that
    fails, or prints anything but one JSON object, raises RuntimeError with the end of its stderr.
    """
    running = {name: torchrun(lab, [*cli.argv(config), "--json"], nproc_per_node)
               for name, config in configs.items()}
    summaries = {}
    try:
        for name, proc in running.items():
            stdout, stderr = proc.communicate(timeout=timeout)
            lines = [line for line in stdout.splitlines() if line.strip()]
            if proc.returncode != 0 or len(lines) != 1:
                raise RuntimeError(f"launch {name!r}: torchrun exited with code {proc.returncode} and "
                                   f"{len(lines)} line(s) on stdout; its stderr ends:\n{stderr[-3000:]}")
            summaries[name] = json.loads(lines[0])
    finally:
        for proc in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return summaries


def world_of_one() -> dict[str, str]:
    """The variables torchrun sets for a world of one rank, with a free port for the rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


# ---------------------------------------------------------------------- one rank of N, in this process
FAKE_PG = "torch.testing._internal.distributed.fake_pg"


@contextlib.contextmanager
def fake_group(world_size: int, rank: int = 0, device: str = "cpu") -> Iterator[object]:
    """This process is rank ``rank`` of ``world_size`` for the block, under PyTorch's fake process
    group (``torch.testing._internal.distributed.fake_pg``, the one torchtitan's memory estimator
    uses): collectives return at once and move no data, while the buffers they need are still
    allocated through the dispatcher, where a :class:`labkit.ledger.Ledger` counts them. Yields a
    1-D device mesh over the ranks (on ``device``'s type); the group is destroyed at the end.

    The module is internal to PyTorch: its absence, or a process group already joined, is one
    :class:`UsageError` line. Enter it outside :func:`labkit.fake.tensors` (the mesh reads ranks).
    """
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:  # pragma: no cover - torch 2.11 and 2.13 both have it
        raise UsageError(f"tracing {world_size} ranks in one process needs PyTorch's fake process group "
                         f"({FAKE_PG}), which torch {torch.__version__} lacks ({exc})") from None
    if dist.is_initialized():
        raise UsageError("a process group is already initialized: a fake-group trace plays its ranks without torchrun")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh(torch.device(device).type, (world_size,))
    finally:
        dist.destroy_process_group()
