"""Work run in the background of the caller's: in a thread of its own, or in a forked copy of this process.

Verification runs its weights proof beside a block-by-block comparison; evaluation scores the
baseline beside the model it is compared with. A ``Work`` is any such job: threads share it through ``work()``, a
process of its own runs it whole through ``work_alone()``, ``figures()`` is its answer (plain
JSON), ``failure`` its first error so far, ``cancel()`` stops it and ``nbytes`` says how big it is.
This module knows how the work runs, not what it is: the fork, the pipe, signals and the
parent's death, and errors carried back as the same kind with the same message.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import sys
import threading
import traceback
import warnings
from typing import Protocol

import torch

from normswap.errors import NormswapError, VerificationError
from normswap.threads import PARALLEL_BYTES


class WorkAlone(Protocol):
    """Work that a process of its own runs whole (``InProcess``): ``figures()`` is its answer, as JSON."""

    def work_alone(self) -> None: ...

    def figures(self) -> dict: ...


class Work(WorkAlone, Protocol):
    nbytes: int

    @property
    def failure(self) -> BaseException | None: ...

    def work(self) -> None: ...

    def cancel(self) -> None: ...


class InThread:
    """A ``Work`` (the weights proof) worked on by a thread of its own, beside other work (a block-by-block
    comparison, on the other core), then by the calling thread too once that is done.

    ``check()`` raises the proof's failure as soon as there is one, so the work beside it can
    stop at its next step; ``result()`` joins in the proof's work, waits for it and returns its
    figures or raises its failure. ``outcome(error)`` is what the caller raises when the work
    beside it failed with ``error``: the proof's failure first, since a wrong weight explains a
    failing model."""

    def __init__(self, work: Work) -> None:
        self.job = work
        self._thread = threading.Thread(target=work.work, name="weights proof", daemon=True)
        self._thread.start()

    def check(self) -> None:
        failure = self.job.failure
        if failure is not None:
            raise failure

    def done(self) -> bool:
        """Whether the thread has finished (every tensor taken, or a failure)."""
        return not self._thread.is_alive()

    def _finish(self) -> None:
        try:
            self.job.work()
        except BaseException:  # an interrupt: the thread stops at its next tensor
            self.cancel()
            raise
        self._thread.join()

    def cancel(self) -> None:
        """Stop the proof (an interrupt), and wait for its thread to finish its tensor."""
        self.job.cancel()
        self._thread.join()

    def result(self) -> dict:
        self._finish()
        return self.job.figures()

    def outcome(self, error: BaseException) -> BaseException:
        self._finish()
        return self.job.failure or error


def in_process(work: Work, cores: int) -> InProcess | None:
    """``work`` started in a forked process of its own (``InProcess``) when it is big
    enough for a second worker to pay for itself (``threads.PARALLEL_BYTES``), on Linux with
    ``cores`` of at least two; else None, and it is for a thread (``InThread``). The process
    works while this one imports and builds models, which hold the interpreter lock that a
    thread's every step needs."""

    if sys.platform != "linux" or not hasattr(os, "fork") or work.nbytes <= PARALLEL_BYTES or cores < 2:
        return None
    try:
        return InProcess(work)
    except OSError:  # no process to be had (EAGAIN, ENOMEM): a thread does the same work
        return None


class InProcess:
    """A ``Work`` (the weights proof, ``name``: what messages call it) worked on by a forked copy of
    this process, on one core, with the interface of ``InThread`` plus ``done()``.

    The copy shares this process's memory until either writes to it, and reads the checkpoints
    through the same disk cache. It runs nothing but the proof: interrupts are this process's to
    handle (it ends the copy, ``cancel``), the answer (figures or failure) goes into a pipe as
    JSON, and the copy leaves with ``os._exit``, so no clean-up of this process (a temporary output
    folder's removal, exit handlers) ever runs in it. It ends with this process, however this one
    ends, and an interrupt while this one waits for it ends it too. A failure comes back as the
    same kind of error with the same message (``VerificationError``, ``NormswapError``,
    ``OSError``); any other is reported as an internal error whose note holds the copy's
    traceback. A copy that dies without answering (the system killed it) is one
    ``NormswapError``."""

    def __init__(self, work: WorkAlone, name: str = "the weights proof") -> None:

        self.job, self.name = work, name
        self._data = bytearray()
        self._answer: dict | None = None
        # the threads of a lockstep comparison each check the copy: one at a time reads its pipe,
        # closes it and reaps it (a descriptor closed twice may be another file's by then)
        self._collecting = threading.RLock()
        read, write = os.pipe()
        parent = os.getpid()
        # an interrupt must not reach the copy before it ignores interrupts: raised there, it would
        # unwind this process's stack, clean-ups and all, in the copy
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            with warnings.catch_warnings():
                # Python 3.12 warns about forking a process with threads: the copy takes no lock
                # another thread may hold (it opens readers of its own, and runs in this thread alone)
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except BaseException:
            os.close(read)
            os.close(write)
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            raise
        if pid == 0:
            _work_in_child(work, read, write, held, parent)  # never returns
        os.close(write)
        self.pid, self._read = pid, read
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)  # an interrupt held meanwhile arrives here
        except BaseException:
            self.cancel()
            raise

    def done(self) -> bool:
        """Whether the copy has answered (without waiting)."""

        with self._collecting:
            if self._answer is not None or self._read < 0:
                return True
            poller = select.poll()  # not select.select, which refuses descriptors above 1023
            poller.register(self._read, select.POLLIN | select.POLLHUP)
            return bool(poller.poll(0))

    def _collect(self) -> dict:
        """The copy's answer, once it has exited (waiting for it); the copy is reaped."""

        with self._collecting:
            if self._answer is None:
                try:
                    while self._read >= 0 and (chunk := os.read(self._read, 1 << 16)):
                        self._data += chunk
                    status = self._reap()
                except BaseException:  # an interrupt while waiting: the copy goes with it
                    self.cancel()
                    raise
                try:
                    answer = json.loads(self._data) if self._data else None
                except ValueError:
                    answer = None
                if not isinstance(answer, dict):
                    answer = {"error": {"kind": "normswap", "message": died(status, self.name)}}
                self._answer = answer
            return self._answer

    def _reap(self) -> int:
        """Close the pipe and wait for the copy to exit: its wait status (0 if already reaped)."""

        if self._read >= 0:
            os.close(self._read)
            self._read = -1
        try:
            return os.waitpid(self.pid, 0)[1]
        except ChildProcessError:  # reaped by an earlier call that an interrupt cut short
            return 0

    def check(self) -> None:
        if self.done():
            failure = self._failure()
            if failure is not None:
                raise failure

    def _failure(self) -> BaseException | None:
        error = self._collect().get("error")
        return None if error is None else rebuilt_error(error, self.name)

    def cancel(self) -> None:
        """End the copy (an interrupt) and reap it."""

        with self._collecting:
            if self._answer is not None:
                return
            self._answer = {"error": {"kind": "normswap", "message": f"{self.name} was cancelled"}}
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self._reap()

    def result(self) -> dict:
        failure = self._failure()
        if failure is not None:
            raise failure
        return self._answer["figures"]

    def outcome(self, error: BaseException) -> BaseException:
        return self._failure() or error


def died(status: int, name: str = "the weights proof") -> str:
    """The line for the process of ``name`` that ended (wait ``status``) without answering."""

    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGBUS:  # a mapped page of a shrunk file
        return f"the process of {name} was killed by SIGBUS: a weight file shrank while it was read"
    how = (f"was killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
           else f"exited with status {os.waitstatus_to_exitcode(status)}")
    return f"the process of {name} {how} before it answered (out of memory?)"


def _work_in_child(work: WorkAlone, read: int, write: int, mask: set, parent: int) -> None:
    """The forked copy's whole life: the work on one core, its answer into ``write``, exit.
    Interrupts are held until it ignores them (``mask``: the signal mask to restore then), and it
    ends with ``parent`` (``_end_with_parent``)."""

    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what an interrupt ends
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _end_with_parent(parent)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(read)
        # one intra-op thread before any torch op: a pool the parent's own parallel ops started
        # does not survive the fork, and the copy's first parallel op would wait on it forever
        torch.set_num_threads(1)
        try:
            work.work_alone()
            answer: dict = {"figures": work.figures()}
        except BaseException as error:  # noqa: BLE001 (sent to the parent, which raises it)
            answer = {"error": error_record(error)}
        data = json.dumps(answer).encode()
        while data:
            data = data[os.write(write, data):]
    finally:
        os._exit(0)


def _end_with_parent(parent: int) -> None:
    """Have the kernel kill this process when ``parent`` ends, however it ends (a SIGKILL, the
    out-of-memory killer): an orphan would hold the parent's descriptors (an output's lock, the
    caller's pipes) until its proof is done. Linux's ``PR_SET_PDEATHSIG``; a parent already gone
    before it was set ends this process now."""

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent:
        os._exit(1)


def error_record(error: BaseException) -> dict:
    """What the parent needs to raise ``error`` again: its kind, message and details."""
    if isinstance(error, VerificationError):
        return {"kind": "verification", "message": str(error)}
    if isinstance(error, NormswapError):
        return {"kind": "normswap", "message": str(error), "exit_code": error.exit_code}
    if isinstance(error, OSError):
        return {"kind": "os", "errno": error.errno, "strerror": error.strerror, "filename": error.filename,
                "filename2": error.filename2, "message": str(error)}

    return {"kind": "internal", "type": type(error).__name__, "message": str(error),
            "traceback": "".join(traceback.format_exception(error))}


def rebuilt_error(record: dict, name: str = "the weights proof") -> BaseException:
    kind, message = record.get("kind"), str(record.get("message", ""))
    if kind == "verification":
        return VerificationError(message)
    if kind == "normswap":
        error = NormswapError(message)
        error.exit_code = int(record.get("exit_code", NormswapError.exit_code))
        return error
    if kind == "os":
        if not isinstance(record.get("errno"), int):
            return OSError(message)
        return OSError(record["errno"], record.get("strerror") or message, record.get("filename"), None,
                       record.get("filename2"))
    error = RuntimeError(f"{name} failed in its process: {record.get('type', 'error')}: {message}")
    error.add_note(str(record.get("traceback", "")))
    return error
