"""The algebraic proof: every stored tensor is what the plan makes it, to the rounding of its dtype.

The conversion plan (rebuilt from the original with the options the checkpoint records, or the
plan the writer just ran) says how each output tensor is made from the original's tensors. For
every output tensor the proof recomputes that value with the writer's own code path
(``normswap.convert.write.expected_blocks``: the same ``fold`` step functions, in float64, one
tensor group and one block of rows at a time, reads shared through the writer's ``ShardSource``)
and compares it elementwise with the stored tensor:

* a tensor the plan leaves as it is, in the same dtype, must be byte-identical to its source;
* every other tensor must equal its float64 value rounded to the stored dtype, to within
  ``ULP_LIMIT`` unit in the last place (ulp) of that dtype. The writer rounds the same float64
  value once, so a faithful tensor is bit-exact; one ulp admits a rounding tie decided the other
  way by a float64 value that differs in its last bits (another summation order, another BLAS).
  Values that are zero up to float64 cancellation (a centred constant row) get an absolute
  allowance of ``ZERO_FLOOR`` times the largest value in their block, far below the rounding of
  any other value there.

The names, shapes, dtypes and shards of the stored tensors must be the plan's, and a NaN or
infinity where the plan makes a finite value fails. The proof reads each file once, so it runs at
disk speed, and it proves every row, including rows no forward probe reads (embedding rows of
tokens outside the probe, positions beyond its length). Its figures name the worst tensor and its
distance, in ulps, from the correctly rounded value.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from normswap.checkpoint.source import CheckpointReader, TensorInfo
from normswap.convert.plan import ConversionPlan, TensorPlan
from normswap.convert.write import ShardSource, expected_blocks, tensors_by_shard
from normswap.dtypes import parse_dtype
from normswap.errors import NormswapError, VerificationError
from normswap.memory import map_large_allocations
from normswap.threads import PARALLEL_BYTES, WorkQueue, tensor_workers

# a stored value may differ from the correctly rounded plan value by at most this many ulps
ULP_LIMIT = 1.0
# absolute allowance for values that are zero up to float64 cancellation, relative to the block's
# largest value: above the float64 error of a d-term sum (d·2⁻⁵³ for d up to 10⁵) and 2¹³ times
# below float32's rounding of that largest value
ZERO_FLOOR = 2.0 ** -36
CHUNK_BYTES = 16 << 20
PROOF_SLICE_ELEMENTS = 2 << 20


def prove_weights(source_dir: Path, converted_dir: Path, plan: ConversionPlan,
                  identical: dict[str, str] | None = None, workers: int | None = None) -> dict:
    """Prove every tensor of ``converted_dir`` is what ``plan`` makes it from ``source_dir``.

    Returns the counts (``byte_identical``, ``recomputed``), the limit and the worst tensor with
    its distance in ulps from the correctly rounded value; raises ``VerificationError`` naming the
    first tensor, element and values that are wrong. ``identical``, when given, receives each
    tensor proven byte-identical to its source: converted name -> source name. ``workers``
    threads share the work (``WeightsProof``; default ``threads.tensor_workers``)."""
    proof = WeightsProof(source_dir, converted_dir, plan)
    if workers is None:
        workers = tensor_workers(proof.nbytes)
    proof.queue.run(lambda queue: proof.work(), workers)
    return proof.figures(identical)


class WeightsProof:
    """The proof of one checkpoint against its plan, as work any number of threads share.

    Each ``work()`` call (one per thread) takes the next tensor in the plan's order until none is
    left, on one core: the work is reads and elementwise float64 arithmetic, which release the
    interpreter lock. A tensor that is not streamed by rows is computed whole in float64; one
    such tensor at a time is, whatever the number of workers, so that memory holds one.
    ``figures()`` gives those of a single pass whatever the split: the first wrong tensor in the
    plan's order (a worker stops taking tensors past the first failure found, and every tensor
    before it is proven by someone), and the worst tensor by ulps, the first of equals. With
    ``mapped`` (set in a process that runs nothing but the proof, ``ProofInProcess``) both
    checkpoints are read over their files' mapped pages instead of copies of them
    (``CheckpointReader``'s ``mapped``)."""

    def __init__(self, source_dir: Path, converted_dir: Path, plan: ConversionPlan) -> None:
        # block-sized float64 temporaries come and go per tensor: give them their own mappings,
        # so the heap does not keep a depth-proportional high-water mark
        map_large_allocations()
        with CheckpointReader(converted_dir) as output:
            check_inventory(plan, output)
        self.paths, self.plan = (source_dir, converted_dir), plan
        self.tensors = [tensor for group in tensors_by_shard(plan).values() for tensor in group]
        self.nbytes = sum(tensor.nbytes for tensor in self.tensors)
        self.results: list[tuple[int, float | None, int]] = []  # (index, ulps or None if identical, off)
        self.queue = WorkQueue(len(self.tensors))
        self._whole = threading.Lock()  # held while a tensor is computed whole
        self.mapped = False

    def cancel(self) -> None:
        """Stop every worker at its next tensor (an interrupt: no figures are wanted)."""
        self.queue.cancel()

    @property
    def failure(self) -> BaseException | None:
        """The first failure in the plan's order among those found so far."""
        return self.queue.failure

    def work(self) -> None:
        """Prove tensors, the next one not taken each time, until none is left or one fails."""
        index: int | None = -1  # a failure to open the checkpoints comes before every tensor
        try:
            with (CheckpointReader(self.paths[0], self.mapped) as source,
                  CheckpointReader(self.paths[1], self.mapped) as output):
                shared = ShardSource(source)
                while (index := self.queue.take()) is not None:
                    tensor = self.tensors[index]
                    if _same_bytes_expected(tensor, source):
                        _prove_identical(tensor, source, output, shared)
                        result = (index, None, 0)
                    elif shared.row_streamable(tensor):
                        result = (index, *_prove_recomputed(tensor, shared, output))
                    else:
                        with self._whole:
                            result = (index, *_prove_recomputed(tensor, shared, output))
                    with self.queue.lock:
                        self.results.append(result)
        except Exception as error:  # raised by figures(), in the calling thread
            # a failure closing the checkpoints, once every tensor was taken, comes after them all
            self.queue.fail(len(self.tensors) if index is None else index, error)

    def figures(self, identical: dict[str, str] | None = None) -> dict:
        """The proof's figures once every ``work()`` has returned (see ``prove_weights``)."""
        if self.failure is not None:
            raise self.failure
        counts = {"tensors": len(self.plan.tensors), "byte_identical": 0, "recomputed": 0}
        worst = {"tensor": None, "ulp": 0.0, "dtype": None, "elements_off_by_rounding": 0}
        for index, units, off in sorted(self.results, key=lambda result: result[0]):
            tensor = self.tensors[index]
            if units is None:
                counts["byte_identical"] += 1
                if identical is not None:
                    identical[tensor.name] = tensor.source
                continue
            counts["recomputed"] += 1
            worst["elements_off_by_rounding"] += off
            if units > worst["ulp"]:
                worst.update(tensor=tensor.name, ulp=units, dtype=tensor.dtype_name)
        return {**counts, "limit_ulp": ULP_LIMIT, "worst": worst}


def planned_identical(plan: ConversionPlan, source_dir: Path) -> dict[str, str]:
    """The tensors ``plan`` keeps byte for byte as the source holds them (converted name ->
    source name): those ``prove_weights`` compares byte for byte."""
    with CheckpointReader(source_dir) as source:
        return {name: tensor.source for name, tensor in plan.tensors.items() if _same_bytes_expected(tensor, source)}


class ProofInThread:
    """A ``WeightsProof`` worked on by a thread of its own, beside other work (a block-by-block
    comparison, on the other core), then by the calling thread too once that is done.

    ``check()`` raises the proof's failure as soon as there is one, so the work beside it can
    stop at its next step; ``result()`` joins in the proof's work, waits for it and returns its
    figures or raises its failure. ``outcome(error)`` is what the caller raises when the work
    beside it failed with ``error``: the proof's failure first, since a wrong weight explains a
    failing model."""

    def __init__(self, proof: WeightsProof) -> None:
        self.proof = proof
        self._thread = threading.Thread(target=proof.work, name="weights proof", daemon=True)
        self._thread.start()

    def check(self) -> None:
        failure = self.proof.failure
        if failure is not None:
            raise failure

    def done(self) -> bool:
        """Whether the thread has finished (every tensor taken, or a failure)."""
        return not self._thread.is_alive()

    def _finish(self) -> None:
        try:
            self.proof.work()
        except BaseException:  # an interrupt: the thread stops at its next tensor
            self.cancel()
            raise
        self._thread.join()

    def cancel(self) -> None:
        """Stop the proof (an interrupt), and wait for its thread to finish its tensor."""
        self.proof.cancel()
        self._thread.join()

    def result(self) -> dict:
        self._finish()
        return self.proof.figures()

    def outcome(self, error: BaseException) -> BaseException:
        self._finish()
        return self.proof.failure or error


def proof_in_process(proof: WeightsProof, cores: int) -> ProofInProcess | None:
    """``proof`` started in a forked process of its own (``ProofInProcess``) when it is big
    enough for a second worker to pay for itself (``threads.PARALLEL_BYTES``), on Linux with
    ``cores`` of at least two; else None, and it is for a thread (``ProofInThread``). The process
    works while this one imports and builds models, which hold the interpreter lock that a
    thread's every step needs."""
    import os
    import sys

    if sys.platform != "linux" or not hasattr(os, "fork") or proof.nbytes <= PARALLEL_BYTES or cores < 2:
        return None
    try:
        return ProofInProcess(proof)
    except OSError:  # no process to be had (EAGAIN, ENOMEM): a thread does the same work
        return None


class ProofInProcess:
    """A ``WeightsProof`` worked on by a forked copy of this process, on one core, with the
    interface of ``ProofInThread`` plus ``done()``.

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

    def __init__(self, proof: WeightsProof) -> None:
        import os
        import signal
        import warnings

        self.proof = proof
        self._data = bytearray()
        self._answer: dict | None = None
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
            _prove_in_child(proof, read, write, held, parent)  # never returns
        os.close(write)
        self.pid, self._read = pid, read
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)  # an interrupt held meanwhile arrives here
        except BaseException:
            self.cancel()
            raise

    def done(self) -> bool:
        """Whether the copy has answered (without waiting)."""
        import select

        if self._answer is not None or self._read < 0:
            return True
        poller = select.poll()  # not select.select, which refuses descriptors above 1023
        poller.register(self._read, select.POLLIN | select.POLLHUP)
        return bool(poller.poll(0))

    def _collect(self) -> dict:
        """The copy's answer, once it has exited (waiting for it); the copy is reaped."""
        import json
        import os

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
                answer = {"error": {"kind": "normswap", "message": _died(status)}}
            self._answer = answer
        return self._answer

    def _reap(self) -> int:
        """Close the pipe and wait for the copy to exit: its wait status (0 if already reaped)."""
        import os

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
        return None if error is None else _rebuilt_error(error)

    def cancel(self) -> None:
        """End the copy (an interrupt) and reap it."""
        import os
        import signal

        if self._answer is not None:
            return
        self._answer = {"error": {"kind": "normswap", "message": "the weights proof was cancelled"}}
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


def _died(status: int) -> str:
    """The line for a proof's process that ended (wait ``status``) without answering."""
    import os
    import signal

    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGBUS:  # a mapped page of a shrunk file
        return "the weights proof's process was killed by SIGBUS: a weight file shrank while it was read"
    how = (f"was killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
           else f"exited with status {os.waitstatus_to_exitcode(status)}")
    return f"the weights proof's process {how} before it answered (out of memory?)"


def _prove_in_child(proof: WeightsProof, read: int, write: int, mask: set, parent: int) -> None:
    """The forked copy's whole life: the proof on one core, its answer into ``write``, exit.
    Interrupts are held until it ignores them (``mask``: the signal mask to restore then), and it
    ends with ``parent`` (``_end_with_parent``)."""
    import json
    import os
    import signal

    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what an interrupt ends
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _end_with_parent(parent)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(read)
        # one intra-op thread before any torch op: a pool the parent's own parallel ops started
        # does not survive the fork, and the copy's first parallel op would wait on it forever
        torch.set_num_threads(1)
        proof.mapped = True  # nothing else runs here for a SIGBUS (a file truncated meanwhile) to end
        try:
            proof.queue.run(lambda queue: proof.work(), 1)
            answer: dict = {"figures": proof.figures()}
        except BaseException as error:  # noqa: BLE001 (sent to the parent, which raises it)
            answer = {"error": _error_record(error)}
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
    import ctypes
    import os
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent:
        os._exit(1)


def _error_record(error: BaseException) -> dict:
    """What the parent needs to raise ``error`` again: its kind, message and details."""
    if isinstance(error, VerificationError):
        return {"kind": "verification", "message": str(error)}
    if isinstance(error, NormswapError):
        return {"kind": "normswap", "message": str(error), "exit_code": error.exit_code}
    if isinstance(error, OSError):
        return {"kind": "os", "errno": error.errno, "strerror": error.strerror, "filename": error.filename,
                "filename2": error.filename2, "message": str(error)}
    import traceback

    return {"kind": "internal", "type": type(error).__name__, "message": str(error),
            "traceback": "".join(traceback.format_exception(error))}


def _rebuilt_error(record: dict) -> BaseException:
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
    error = RuntimeError(f"{record.get('type', 'error')} in the weights proof's process: {message}")
    error.add_note(str(record.get("traceback", "")))
    return error


def rebuilt_conversion_plan(original_dir: Path, original_config: dict, options: dict,
                            stored: dict[str, TensorInfo]) -> ConversionPlan:
    """The plan a conversion ran, rebuilt from the original and the options its provenance
    records (``method``, ``fold_gains``, ``dtype``), planned from the adapter's declarations.
    The output dtype is the source's unless the stored tensors show a cast to the recorded dtype
    (``--dtype``), which then applies to every floating tensor."""
    from normswap.convert.planning import plan_conversion

    def plan(dtype: torch.dtype | None) -> ConversionPlan:
        with CheckpointReader(original_dir) as reader:
            return plan_conversion(original_dir, original_config, reader, method=options.get("method", "exact"),
                                   fold_gains=bool(options.get("fold_gains", False)), dtype=dtype,
                                   build_class=False)[1]

    return _with_recorded_dtype(plan, options, stored)


def _with_recorded_dtype(plan, options: dict, stored: dict[str, TensorInfo]) -> ConversionPlan:
    """``plan(None)``, or ``plan(recorded dtype)`` when the stored floating tensors were cast."""
    planned = plan(None)
    cast = any(name in stored and tensor.dtype.is_floating_point and stored[name].dtype_name != tensor.dtype_name
               for name, tensor in planned.tensors.items())
    recorded = parse_dtype(options.get("dtype")) if isinstance(options.get("dtype"), str) else None
    return plan(recorded) if cast and recorded is not None else planned


def rebuilt_rotation_plan(reference_dir: Path, reference_config: dict, rotation: dict, matrix: torch.Tensor,
                          options: dict, stored: dict[str, TensorInfo]) -> ConversionPlan:
    """The plan a rotation ran: the rotation plan of its source (an original or a folded
    conversion) in its recorded form with ``rotate.plan.add_rotation``'s steps for Q = ``matrix``, the matrix stored
    beside the weights. A seeded Q (``hadamard``, ``orthogonal``) must be the one its recorded
    method and seed make; a ``pca`` Q is measured on calibration text and is taken as stored
    (the file's hash and orthogonality are checked when it is loaded). An online Hadamard
    (``rotate.online``) adds its step to every MLP down projection, once its record is checked."""
    from normswap.checkpoint.rotations import rotation_method
    from normswap.rotate.matrices import Rotation
    from normswap.rotate.online import add_online_hadamard, check_spec
    from normswap.rotate.pipeline import planned_rotation, seeded_rotation
    from normswap.rotate.plan import add_rotation

    method, seed, form = rotation.get("method"), rotation.get("seed"), rotation.get("form", "free")
    record = rotation_method(method)
    if record is not None and record.seeded:
        made = seeded_rotation(method, form, matrix.shape[0], seed).matrix
        error = float((made - matrix).abs().max())
        if not error <= 1e-12:
            raise VerificationError(f"weights proof: the stored rotation is not the {method} matrix of seed {seed} "
                                    f"(max |Δ| = {error:.3g})")
    q = Rotation(str(method), seed, matrix, str(rotation.get("construction", "")))

    def plan(dtype: torch.dtype | None) -> ConversionPlan:
        with CheckpointReader(reference_dir) as reader:
            rotation_plan, fixed = planned_rotation(reference_dir, reference_config, reader, form, dtype)
        add_rotation(rotation_plan.plan, rotation_plan.architecture, q, fixed)
        if "online_hadamard" in rotation:  # the recorded H must be the one normswap makes here
            check_spec(rotation["online_hadamard"], rotation_plan.meta)
            add_online_hadamard(rotation_plan.plan, rotation_plan.architecture, rotation_plan.meta)
        return rotation_plan.plan

    return _with_recorded_dtype(plan, options, stored)


def check_inventory(plan: ConversionPlan, output: CheckpointReader) -> None:
    """The stored tensors are the plan's: the same names, shapes, dtypes and shards."""
    where = output.path
    extra = sorted(set(output.tensors) - set(plan.tensors))
    if extra:
        raise VerificationError(f"weights proof: {where} has a tensor the conversion does not make: {extra[0]}")
    sharded = len(plan.shards) > 1
    for name, tensor in plan.tensors.items():
        stored = output.tensors.get(name)
        if stored is None:
            raise VerificationError(f"weights proof: {where} lacks the tensor {name}")
        if tuple(stored.shape) != tuple(tensor.shape):
            raise VerificationError(f"weights proof: {name} has shape {list(stored.shape)}; the conversion makes it "
                                    f"{list(tensor.shape)}")
        if stored.dtype_name != tensor.dtype_name:
            raise VerificationError(f"weights proof: {name} is stored as {stored.dtype_name}; the conversion makes "
                                    f"it {tensor.dtype_name}")
        if sharded and stored.shard != tensor.shard:
            raise VerificationError(f"weights proof: {name} is in {stored.shard}; the conversion writes it into "
                                    f"{tensor.shard}")


def _same_bytes_expected(tensor: TensorPlan, source: CheckpointReader) -> bool:
    return (not tensor.steps and tensor.source is not None
            and source.tensors[tensor.source].dtype_name == tensor.dtype_name)


def _row_chunks(reader: CheckpointReader, name: str, buffer: torch.Tensor) -> Iterator[torch.Tensor]:
    """``name`` in slices of rows of at most CHUNK_BYTES, read into ``buffer`` (overwritten by the next)."""
    info = reader.tensors[name]
    # A tensor of no bytes has no rows to walk, whatever its first dimension says ([2**62, 0]):
    # past this test every dimension is at least 1, so the loop runs at most ``nbytes`` times.
    if len(info.shape) == 0 or info.nbytes == 0 or not reader.is_safetensors:
        yield reader.get(name)
        return
    rows = max(1, CHUNK_BYTES // (info.nbytes // info.shape[0]))
    for start in range(0, info.shape[0], rows):
        yield reader.read_rows(name, start, min(rows, info.shape[0] - start), buffer)


def _words(values: torch.Tensor) -> torch.Tensor:
    """The bytes of ``values`` as 8-byte words where they divide evenly (compared 4x faster than bytes)."""
    raw = values.contiguous().reshape(-1).view(torch.uint8)
    return raw.view(torch.int64) if raw.numel() % 8 == 0 and raw.data_ptr() % 8 == 0 else raw


def _prove_identical(tensor: TensorPlan, source: CheckpointReader, output: CheckpointReader,
                     shared: ShardSource) -> None:
    # reused for every tensor: a fresh pair of buffers per tensor would fault in new pages each time
    buffers = shared.buffer("source chunk", CHUNK_BYTES), shared.buffer("stored chunk", CHUNK_BYTES)
    pairs = zip(_row_chunks(source, tensor.source, buffers[0]), _row_chunks(output, tensor.name, buffers[1]),
                strict=True)
    for before, after in pairs:
        if not torch.equal(_words(before), _words(after)):
            raise VerificationError(f"weights proof: {tensor.name} should be {tensor.source} unchanged, but its "
                                    "bytes differ")


def _prove_recomputed(tensor: TensorPlan, shared: ShardSource, output: CheckpointReader) -> tuple[float, int]:
    """(worst distance in ulps from the correctly rounded plan value, elements not bit-exact)."""
    row = max(1, math.prod(tensor.shape[1:]))
    worst, off = 0.0, 0
    for start, expected in expected_blocks(tensor, shared, PROOF_SLICE_ELEMENTS):
        count = expected.shape[0] if expected.dim() else 1
        nbytes = count * row * tensor.dtype.itemsize
        stored = (_stored_rows(output, tensor.name, start, count, shared.buffer("stored", nbytes))
                  if expected.dim() else output.get(tensor.name))
        rounded = shared.buffer("rounded", nbytes).view(tensor.dtype).view(expected.shape)
        rounded.copy_(expected)  # rounded to nearest as ``Tensor.to`` rounds
        # finite when no value is NaN (which rounds to NaN) or rounds to infinity (aminmax of the
        # rounded values: one pass over the narrow dtype, no temporary)
        finite = not expected.numel() or all(math.isfinite(float(bound)) for bound in torch.aminmax(rounded))
        if not finite:
            _refuse_overflow(tensor, start, expected, rounded)
        elif torch.equal(_words(rounded), _words(stored)):  # bit-exact and finite
            continue
        differs = ~(rounded == stored)
        units = _units(stored[differs], rounded[differs], expected, tensor.dtype)
        if not bool((units <= ULP_LIMIT).all()):
            _refuse(tensor, start, differs, units, stored, expected)
        worst, off = max(worst, float(units.max())), off + int(differs.sum())
    return worst, off


def _refuse_overflow(tensor: TensorPlan, start: int, expected: torch.Tensor, rounded: torch.Tensor) -> None:
    """A finite value the plan makes that the output dtype cannot hold (it rounds to infinity)."""
    overflowed = torch.isinf(rounded) & torch.isfinite(expected)
    if not bool(overflowed.any()):
        return  # every infinity is the plan's own (or a NaN): the elementwise comparison judges it
    first = overflowed.nonzero()[0].tolist()
    value = float(expected[tuple(first)])
    if expected.dim():
        first[0] += start
    raise VerificationError(
        f"weights proof: {tensor.name}{first} is {value:.6g} in float64, beyond {tensor.dtype_name}'s largest value "
        f"{torch.finfo(tensor.dtype).max:.6g}: stored as {tensor.dtype_name} it becomes infinite (convert to a wider "
        "--dtype)")


def _stored_rows(output: CheckpointReader, name: str, start: int, count: int, buffer: torch.Tensor) -> torch.Tensor:
    if output.is_safetensors:
        return output.read_rows(name, start, count, buffer)
    return output.get(name).narrow(0, start, count)


def _units(stored: torch.Tensor, rounded: torch.Tensor, block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|stored - rounded| in ulps of ``dtype`` at ``rounded``, less the zero floor of ``block``
    (NaN where either is not finite, so that it fails)."""
    info = torch.finfo(dtype)
    rounded64, stored64 = rounded.double(), stored.double()
    _, exponent = torch.frexp(rounded64)
    ulp = torch.where(rounded64.abs() < info.tiny, info.tiny * info.eps, info.eps * torch.exp2((exponent - 1).double()))
    finite = block[torch.isfinite(block)]
    floor = ZERO_FLOOR * float(finite.abs().max()) if finite.numel() else 0.0
    distance = ((stored64 - rounded64).abs() - floor).clamp(min=0)
    units = distance / ulp
    units[~(torch.isfinite(stored64) & torch.isfinite(rounded64))] = math.nan
    return units


def _refuse(tensor: TensorPlan, start: int, differs: torch.Tensor, units: torch.Tensor, stored: torch.Tensor,
            expected: torch.Tensor) -> None:
    """One line naming the first element beyond the limit: its index, stored and planned values."""
    bad = ~(units <= ULP_LIMIT)
    positions = differs.nonzero()
    first = positions[int(bad.nonzero()[0])].tolist()
    if expected.dim():
        first[0] += start
    index = tuple(first)
    local = tuple([first[0] - start, *first[1:]]) if expected.dim() else ()
    value, planned = float(stored[local]), float(expected[local])
    how = "not finite" if not math.isfinite(float(units[bad][0])) else f"{float(units[bad][0]):.4g} ulps off"
    where = f"{tensor.name}{list(index)}" if index else tensor.name
    raise VerificationError(
        f"weights proof: {where} is {value:.6g}, but the conversion makes it {planned:.6g} ({tensor.dtype_name}, "
        f"{how}; {int(bad.sum())} element{'s' if int(bad.sum()) != 1 else ''} of this block beyond "
        f"{ULP_LIMIT:g} ulp)")
