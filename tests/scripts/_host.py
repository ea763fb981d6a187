"""The script host: forks each run of a test script from a process that has imported TensorFlow.

``python -m tests.scripts._host``, started by ``tests.helpers`` once per
pytest process. It imports TensorFlow, Keras, numpy and the package, which
initialises no device (see this package's docstring), then serves requests,
one JSON line each on its stdin, a JSON line of reply on its stdout:

- ``{"op": "start", "module": ..., "args": [...], "env": {...}, "stdout": path,
  "stderr": path}``: forks a child that runs ``module`` as ``__main__`` with
  ``sys.argv`` ``[module, *args]``, the environment ``env`` and its outputs in
  those files, as ``python -m module *args`` would from a fresh interpreter
  whose imports are done; replies ``{"pid": ...}``.
- ``{"op": "wait", "pid": ..., "timeout": seconds}``: replies
  ``{"returncode": ...}`` (``-N``: killed by signal N, as ``subprocess``
  says), or ``{"timeout": true}`` after killing a child that ran longer.

Each child is still a fresh process for TensorFlow: its devices, a strategy
or a worker cluster are set up there for the first time. What it skips is
the import (~4.5 s of CPU a run on 2 cores; a two-replica script 15-17 s ->
10 s). The host ends when its stdin closes.
"""

import atexit
import json
import os
import runpy
import signal
import sys
import time
import traceback

import keras  # noqa: F401
import numpy  # noqa: F401
import tensorflow  # noqa: F401

import gradient_accumulator  # noqa: F401
import tests.scripts  # noqa: F401


def _exit_code(exit):
    """The status ``SystemExit(exit.code)`` ends an interpreter with (a message: printed, 1)."""
    if exit.code is None or isinstance(exit.code, int):
        return exit.code or 0
    print(exit.code, file=sys.stderr)
    return 1


def _run_child(message, channels):
    """In the forked child: the script as ``__main__``; never returns."""
    code = 1
    try:
        for fd in channels:
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(message["env"])
        for fd, path in ((1, message["stdout"]), (2, message["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        sys.argv = [message["module"], *message["args"]]
        try:
            runpy.run_module(message["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit:
            code = _exit_code(exit)
        # The interpreter's own shutdown, as in a process of its own.
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid, timeout):
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"returncode": os.waitstatus_to_exitcode(status)}
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"timeout": True}
        time.sleep(0.02)


def main():
    # The requests and replies on descriptors of their own: nothing a child
    # prints (or the host's imports) can reach the replies.
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    channels = (requests.fileno(), replies.fileno())
    print(json.dumps({"ready": os.getpid()}), file=replies, flush=True)
    for line in requests:
        message = json.loads(line)
        if message["op"] == "start":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_child(message, channels)
            reply = {"pid": pid}
        else:
            reply = _wait(message["pid"], message["timeout"])
        print(json.dumps(reply), file=replies, flush=True)


if __name__ == "__main__":
    main()
