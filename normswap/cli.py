"""The ``normswap`` command line.

Each subcommand lives beside the code it drives, in a module that offers two functions:
``configure(parser)`` adds its arguments and ``run(args) -> int`` does the work. This file only
dispatches, and is the one boundary that turns a ``NormswapError`` (bad input, exit 2; failed
verification, exit 3) or an ``OSError`` (exit 2) into one line on stderr. Anything else is a bug
in normswap: one line names its type and message and the temporary file that holds its full
traceback, and the exit status is 70. A Rust panic (``pyo3_runtime.PanicException``, a
``BaseException``), which a tokenizer's regex can cause, is one line naming the tokenizer file and
its regexes, exit 2. Outputs are installed only after a command succeeds, so nothing is left
behind.

Interrupts are handled from ``main``'s first line: every signal that ends a process by default and
that a user or the system sends to stop a command (``INTERRUPTS``: SIGINT, SIGTERM, SIGHUP from a
closed terminal, SIGQUIT, SIGUSR1) is one interrupt. The first one before anything
is installed raises ``KeyboardInterrupt``, whose clean-up leaves nothing and ends in one line and
exit 130; further interrupts while that clean-up runs are only counted. Once an output is
installed (``normswap.checkpoint.output.installed``), an interrupt no longer stops the command:
it finishes, says that the output is complete, and exits 130.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
from typing import NoReturn

from normswap import __version__
from normswap.errors import NormswapError, one_line, options_named

# (subcommand, module implementing it, one-line help)
SUBCOMMANDS: list[tuple[str, str, str]] = [
    ("convert", "normswap.commands.convert", "convert a LayerNorm checkpoint into an exact RMSNorm checkpoint"),
    ("rotate", "normswap.commands.rotate", "write an exactly rotated checkpoint (Hadamard, orthogonal or PCA basis)"),
    ("inspect", "normswap.commands.inspect", "print the conversion plan for a checkpoint; writes nothing"),
    ("verify", "normswap.commands.verify", "compare a converted checkpoint against its original"),
    ("eval", "normswap.evaluation.cli", "perplexity and lm-eval scores, optionally side by side with a baseline"),
    ("run", "normswap.evaluation.recipe_cli", "run a recipe: convert, verify, evaluate and report"),
    ("geometry", "normswap.analysis.cli", "measure how hidden states use the all-ones direction"),
]


class _Parser(argparse.ArgumentParser):
    """argparse with normswap's error form: one line on stderr, exit 2 (no usage block; --help has it).

    Options are never abbreviated: for a tool that writes files, ``--fold-gain`` taken silently
    as ``--fold-gains`` is a mistyped flag acted on. A subcommand names its unknown options
    before anything else is checked, so that ``--ouy zz`` is reported as ``--ouy``, not as
    ``--out`` missing."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        if self._subparsers is None:  # a subcommand's own options; the top level only dispatches
            strings = sys.argv[1:] if args is None else list(args)
            unknown = []
            for arg in strings:
                if arg == "--":
                    break
                parsed = self._parse_optional(arg)
                if parsed is not None and parsed[0] is None:
                    unknown.append(arg)
            if unknown:
                self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")
        sys.exit(2)


def build_parser(only: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, object]]:
    """The parser with every subcommand's arguments, or with ``only`` that one's.

    Command modules import only the standard library at module level, and ``normswap --help``
    (``only`` given but not a subcommand) imports none of them.
    """
    parser = _Parser(
        prog="normswap", description="Exact LayerNorm -> RMSNorm conversion of transformer checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"normswap {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parser.subcommand_parsers = {}  # so that a stray option is reported by its own command
    modules: dict[str, object] = {}
    for name, module_name, help_text in SUBCOMMANDS:
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        parser.subcommand_parsers[name] = sub_parser
        if only is None or name == only:
            module = importlib.import_module(module_name)
            module.configure(sub_parser)
            modules[name] = module
    return parser, modules


# Python already turns SIGPIPE into BrokenPipeError (one line from ``_run``, as any OSError).
INTERRUPTS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1")
                   if hasattr(signal, name))


class _Interrupts:
    """Interrupt handling for one command (``INTERRUPTS``, see the module docstring); ``restore``
    puts back what was there."""

    def __init__(self) -> None:
        self.count = 0
        self.before = len(self._installed())  # outputs of earlier commands in this process do not count
        main_thread = threading.current_thread() is threading.main_thread()
        # a process started with a signal ignored (SIGINT for ``cmd &`` in a script) keeps ignoring it
        self.previous = {signum: signal.signal(signum, self._on_signal)
                         for signum in INTERRUPTS
                         if main_thread and signal.getsignal(signum) is not signal.SIG_IGN}

    @staticmethod
    def _installed() -> list:
        output = sys.modules.get("normswap.checkpoint.output")  # not imported: nothing was installed
        return output.installed if output is not None else []

    def _on_signal(self, signum, frame) -> None:
        self.count += 1
        if self.count == 1 and len(self._installed()) == self.before:
            raise KeyboardInterrupt

    def outcome(self, command: str) -> int | None:
        """After an interrupt: the line saying what was left, and exit 130; None when there was none."""
        if not self.count:
            return None
        installed = self._installed()[self.before:]
        if installed:
            done = ", ".join(str(path) for path in installed)
            print(f"normswap {command}: interrupted after the output was complete: {done} is installed and whole",
                  file=sys.stderr)
        else:
            print(f"normswap {command}: interrupted; nothing was written", file=sys.stderr)
        return 130

    def restore(self, command_line: bool) -> None:
        # A command run from the shell has decided its exit status: ignoring SIGINT from here on
        # keeps a late one from killing the interpreter's shutdown (exit -2, no message).
        for signum, previous in self.previous.items():
            signal.signal(signum, signal.SIG_IGN if command_line and signum == signal.SIGINT else previous)


def main(argv: list[str] | None = None) -> int:
    interrupts = _Interrupts()  # before anything else, so that no interrupt prints a traceback
    command, command_line = "command", argv is None
    try:
        argv = sys.argv[1:] if argv is None else argv
        command = next((arg for arg in argv if not arg.startswith("-")), "") or command
        code = _run(argv, interrupts)
    except KeyboardInterrupt:
        interrupts.count = max(interrupts.count, 1)
        code = 130
    except BaseException as error:
        if isinstance(error, SystemExit | GeneratorExit):
            raise
        if _rust_panic(error) and not interrupts.count:  # raised before a command ran (argument parsing)
            print(f"normswap {command}: error: {_one_line(_panic_line(error, argparse.Namespace()))}",
                  file=sys.stderr)
            code = 2
        elif not interrupts.count:
            raise
        else:
            code = 130  # a library turned the interrupt into an error of its own (an import that "failed")
    finally:
        interrupts.restore(command_line)
    code = interrupts.outcome(command) or code
    if command_line and interrupts.count:
        # Interrupted from the shell: every output is installed or removed, so leave now. The
        # interpreter's shutdown could otherwise be cut short by a late SIGINT (exit -2, no message).
        _leave(code, exit_handlers=False)
    return code


def entry() -> NoReturn:
    """The ``normswap`` command (and ``python -m normswap``): ``main()``, then exit with its code.

    Once a command that imported torch is done (every output installed or removed), and no
    thread but daemons is left to wait for, it leaves after running the exit handlers
    (temporary files, logging) without the interpreter's teardown of torch and transformers,
    object by object, which takes 1.5-2 s."""
    code = main()
    waiting = [thread for thread in threading.enumerate()
               if thread is not threading.main_thread() and not thread.daemon and thread.is_alive()]
    if "torch" in sys.modules and not waiting:
        _leave(code, exit_handlers=True)
    sys.exit(code)


def _leave(code: int, exit_handlers: bool) -> NoReturn:
    if exit_handlers:
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):  # a reader that went away (``| head``) wants no more
            stream.flush()
    os._exit(code)


def _run(argv: list[str], interrupts: _Interrupts) -> int:
    # Hub and transformers chatter would bury our own one-line messages.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # transformers sets its logger's level when it is first imported, from TRANSFORMERS_VERBOSITY
    # (default warning): the level below holds only if transformers is already imported.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    chosen = next((arg for arg in argv if not arg.startswith("-")), "")
    parser, modules = build_parser(chosen)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.subcommand_parsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    from normswap.commands import quiet_progress_bars

    quiet_progress_bars(args)  # before the hub download or any library draws a bar
    try:
        with options_named({}):  # messages name the command's flags, also where it calls the API
            if not getattr(args, "json", False):
                return int(modules[args.command].run(args) or 0)
            # --json: stdout carries the JSON alone; every other line goes to stderr.
            args.json_stream = sys.stdout
            with contextlib.redirect_stdout(sys.stderr):
                return int(modules[args.command].run(args) or 0)
    except NormswapError as error:
        if interrupts.count:
            raise KeyboardInterrupt from None  # the interrupt surfaced as this error: report the interrupt
        print(f"normswap {args.command}: error: {_one_line(str(error))}", file=sys.stderr)
        return error.exit_code
    except OSError as error:
        if interrupts.count:
            raise KeyboardInterrupt from None
        # a file the command had to read or write (an input, or a report in --out) failed
        reason = error.strerror or _one_line(str(error)) or type(error).__name__
        where = f": {error.filename}" if error.filename else ""
        print(f"normswap {args.command}: error: {reason}{where}", file=sys.stderr)
        return 2
    except BaseException as error:  # the last line of defence: a bug in normswap, reported in one line
        if isinstance(error, KeyboardInterrupt | SystemExit | GeneratorExit):
            raise
        if interrupts.count:
            raise KeyboardInterrupt from None  # a library turned the interrupt into an error of its own
        if _rust_panic(error):  # a tokenizer's regex made the Rust library give up: the input's fault
            print(f"normswap {args.command}: error: {_one_line(_panic_line(error, args))}", file=sys.stderr)
            return 2
        print(f"normswap {args.command}: {INTERNAL_ERROR} {type(error).__name__}: {_one_line(str(error))[:300]} "
              f"(full traceback in {_save_traceback()}; outputs were not installed)", file=sys.stderr)
        return INTERNAL_EXIT


def _rust_panic(error: BaseException) -> bool:
    from normswap.checkpoint.tokenizer_panics import is_rust_panic

    return is_rust_panic(error)


def _panic_line(error: BaseException, args: argparse.Namespace) -> str:
    """The line for a Rust panic: the tokenizer files among the command's local inputs."""
    from normswap.checkpoint.tokenizer_panics import panic_line
    from normswap.commands import command_inputs

    try:
        folders = [path for path in command_inputs(args) if path.is_dir()]
    except Exception:  # an input that cannot be listed: the line names no file
        folders = []
    return panic_line(error, folders)


# what the last line of defence prints: every refusal normswap expects has a line of its own
INTERNAL_ERROR = "internal error:"
INTERNAL_EXIT = 70  # EX_SOFTWARE (sysexits.h)


def _save_traceback() -> str:
    """Write the exception being handled, traceback and all, to a new temporary file; its path."""
    import tempfile
    import traceback

    try:
        fd, name = tempfile.mkstemp(prefix="normswap-traceback-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(traceback.format_exc())
        return name
    except OSError:
        return "nowhere: the temporary folder is not writable"


def _one_line(text: str) -> str:
    """Messages may quote a file's content or an exception's text: keep them to one line."""
    return one_line(text)


if __name__ == "__main__":
    sys.exit(main())
