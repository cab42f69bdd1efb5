"""A prewarmed Python for the suite's shown commands: each ``.venv/bin/python script.py ...`` runs in a
fork of one interpreter that has already imported torch, instead of paying that import again.

Why: the suite runs about 150 lab commands as a reader types them, and each fresh interpreter spends
one to two seconds importing torch (and torch._dynamo, which every fake-tensor trace loads) before
the lab's first line. Forking a process that has done it once keeps what the command does and drops
that repeated start-up.

What stays as in a fresh interpreter: the script runs as ``__main__`` from its own file with its
argv, the command's working directory, environment, stdin, stdout and stderr (the client hands its
file descriptors over), ``sys.path`` with the script's folder first, its exit code (``sys.exit``, an
uncaught exception's traceback and 1) and its ``atexit`` handlers. What differs, and is covered
elsewhere: torch's import-time warnings are not shown again (tests/test_commands.py runs every
lab page's command in a truly fresh shell). Only what ``import torch`` itself loads is imported
before the fork (torch._dynamo, which torch loads on first use, aside), so a lab that forgets an
import fails here as it would for a reader. A command whose environment differs from the server's
in what Python or torch read at import (anything but ``HOME``, ``PWD``, ``OLDPWD``, ``SHLVL``, ``_``)
runs in a fresh interpreter, as does everything when the server is gone.

    python tests/prewarmed.py serve SOCKET        # the server (tests/test_commands.py starts it)
    python -I -S tests/prewarmed.py SOCKET script.py args...   # the client, in place of .venv/bin/python
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import sys

IGNORED = {"HOME", "PWD", "OLDPWD", "SHLVL", "_"}  # read by no import the server has done


def serve(path: str) -> None:
    import torch  # noqa: F401  - what every lab imports first
    import torch._dynamo  # noqa: F401  - what torch loads on first use (every fake trace)

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reap themselves
    base_path = sys.path[1:]  # sys.path[0] is this file's folder
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    while True:
        conn, _ = server.accept()
        request, fds = _receive(conn)
        if os.fork() == 0:
            server.close()
            _run(conn, request, fds, base_path)  # never returns
        conn.close()
        for fd in fds:
            os.close(fd)


def _receive(conn) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(1 << 20, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    size = struct.unpack("!I", data[:4])[0]
    body = data[4:]
    while len(body) < size:
        body += conn.recv(size - len(body))
    return json.loads(body), list(fds)


def _run(conn, request: dict, fds: list[int], base_path: list[str]) -> None:
    """In the forked child: become the command, run the script as __main__, send back its exit code."""
    import atexit
    import io
    import runpy
    import tempfile
    import threading

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # read TMPDIR again
    encoding = sys.stdout.encoding
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(open(0, "rb", closefd=False), encoding=encoding)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(open(1, "wb", closefd=False), encoding=encoding,
                                                   line_buffering=os.isatty(1))
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(open(2, "wb", closefd=False), encoding=encoding,
                                                   errors="backslashreplace", line_buffering=True)
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[:] = [os.path.dirname(os.path.realpath(script)), *base_path]

    def orphaned() -> None:  # the client is gone (its test timed out): stop too
        conn.recv(1)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    for thread in threading.enumerate():  # as an interpreter does at exit: wait for non-daemon threads
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            code = code or 120
    try:
        conn.sendall(struct.pack("!i", code))
    finally:
        os._exit(code)


def client(path: str, argv: list[str]) -> None:
    """Run ``argv`` (a script and its arguments) in a fork of the server at ``path``, or, when the server
    cannot take it, in a fresh interpreter (this one is started with -I -S: it must start fast)."""
    python = sys.executable
    with open(f"{path}.env", encoding="utf-8") as f:
        server_env = json.load(f)
    env = dict(os.environ)
    same = {k: v for k, v in env.items() if k not in IGNORED} == server_env
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if not same or not argv or not argv[0].endswith(".py"):
            raise OSError("a different environment, or not a script (-c, -m)")
        conn.connect(path)
    except OSError:
        os.execv(python, [python, *argv])
    body = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": env}).encode()
    conn.sendmsg([struct.pack("!I", len(body)) + body],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]).tobytes())])
    reply = b""
    while len(reply) < 4:
        more = conn.recv(4 - len(reply))
        if not more:
            sys.exit(1)  # the child died without a word (a signal)
        reply += more
    sys.exit(struct.unpack("!i", reply)[0])


def write_env(path: str) -> None:
    """What the server's environment is, for clients to compare theirs with."""
    with open(f"{path}.env", "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in os.environ.items() if k not in IGNORED}, f)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        write_env(sys.argv[2])
        serve(sys.argv[2])
    else:
        client(sys.argv[1], sys.argv[2:])
