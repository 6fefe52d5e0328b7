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

Two ways to run it, with the same checks and figures: ``WeightsProof`` proves a checkpoint on
disk, recomputing each value from the original (``normswap verify``); ``WrittenProof`` proves
each block as the writer writes it (``convert`` and ``rotate``), against the float64 value the
writer computed and the stored bytes read back at once from the file just written, so that the
source is read once for the write and its proof.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import torch

from normswap.architectures import ARCHITECTURES
from normswap.checkpoint import safetensors_io
from normswap.checkpoint.rotations import rotation_method
from normswap.checkpoint.source import CheckpointReader, TensorInfo
from normswap.convert.plan import ConversionPlan, TensorPlan
from normswap.convert.planning import plan_conversion
from normswap.convert.write import ScratchBuffers, ShardSource, expected_blocks, tensors_by_shard
from normswap.dtypes import parse_dtype
from normswap.errors import VerificationError
from normswap.memory import map_large_allocations
from normswap.rotate.matrices import Rotation
from normswap.rotate.plan import add_rotation
from normswap.threads import WorkQueue, tensor_workers

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

    Each ``work()`` call (one per thread) takes the next tensor in the proof's order until none
    is left, on one core: the work is reads and elementwise float64 arithmetic, which release the
    interpreter lock. The order is the plan's, except that the tensors ``first`` names come first
    (those a comparison beside the proof reads, ``layerwise.probed_tensors``: it then finds them
    in the page cache, where the pair may be too big for the cache to hold until the proof came
    to them). A tensor that is not streamed by rows is computed whole in float64; one such
    tensor at a time is, whatever the number of workers, so that memory holds one.
    ``figures()`` gives those of a single pass whatever the split: the first wrong tensor in the
    proof's order (a worker stops taking tensors past the first failure found, and every tensor
    before it is proven by someone), and the worst tensor by ulps, the first of equals in the
    plan's order. With
    ``mapped`` (set in a process that runs nothing but the proof, ``work_alone``) both
    checkpoints are read over their files' mapped pages instead of copies of them
    (``CheckpointReader``'s ``mapped``)."""

    def __init__(self, source_dir: Path, converted_dir: Path, plan: ConversionPlan,
                 first: Collection[str] = ()) -> None:
        # block-sized float64 temporaries come and go per tensor: give them their own mappings,
        # so the heap does not keep a depth-proportional high-water mark
        map_large_allocations()
        with CheckpointReader(converted_dir) as output:
            check_inventory(plan, output)
        self.paths, self.plan = (source_dir, converted_dir), plan
        self.tensors = [tensor for group in tensors_by_shard(plan).values() for tensor in group]
        first = set(first)
        # the proof's order: the tensors ``first`` names, then the rest, each part in the plan's order
        self.order = sorted(range(len(self.tensors)), key=lambda index: self.tensors[index].name not in first)
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
        turn: int | None = -1  # a failure to open the checkpoints comes before every tensor
        try:
            with (CheckpointReader(self.paths[0], self.mapped) as source,
                  CheckpointReader(self.paths[1], self.mapped) as output):
                shared = ShardSource(source)
                while (turn := self.queue.take()) is not None:
                    index = self.order[turn]
                    tensor = self.tensors[index]
                    if shared.keeps_bytes(tensor):
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
            self.queue.fail(len(self.tensors) if turn is None else turn, error)

    def work_alone(self) -> None:
        """The whole proof on one core, in a process that runs nothing else: both checkpoints read
        over their files' mapped pages (nothing else there for a SIGBUS, a file truncated
        meanwhile, to end)."""
        self.mapped = True
        self.queue.run(lambda queue: self.work(), 1)

    def figures(self, identical: dict[str, str] | None = None) -> dict:
        """The proof's figures once every ``work()`` has returned (see ``prove_weights``)."""
        if self.failure is not None:
            raise self.failure
        return _figures(self.plan, self.tensors, self.results, identical)


class WrittenProof:
    """The proof taken while the writer writes (a ``write.Witness``), tensor by tensor and block
    by block: each block of a computed tensor (the float64 value the writer computed, before its
    cast) against its stored bytes, read back from the file just written, by ``_prove_block``;
    each block of a kept tensor, byte for byte, against the source bytes the writer read and
    copied. Nothing is recomputed and the source is not read again. ``figures()`` (after the
    write) are those ``prove_weights`` gives for the same checkpoint, once the stored inventory
    is the plan's (``check_inventory``). A wrong block raises ``VerificationError`` in the writer,
    which then fails with it."""

    def __init__(self, plan: ConversionPlan) -> None:
        from normswap.verify.layerwise import probed_tensors

        self.plan = plan
        architecture = ARCHITECTURES.get(plan.model_type)
        # what a comparison of the first blocks reads (the plan holds no config: blocks 0 and 1)
        self.last = probed_tensors(plan.tensors, {}, None if architecture is None else architecture.blocks)
        self._results: dict[str, tuple[float | None, int]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()  # each writer thread's ``ScratchBuffers``

    def identical(self, tensor: TensorPlan, expected: torch.Tensor, fd: int, position: int) -> None:
        stored = self._stored(fd, position, expected.numel(), "stored chunk")
        if not torch.equal(_words(expected), _words(stored)):
            raise VerificationError(f"weights proof: {tensor.name} should be {tensor.source} unchanged, but its "
                                    "bytes differ")
        with self._lock:
            self._results[tensor.name] = (None, 0)

    def computed(self, tensor: TensorPlan, start: int, value: torch.Tensor, fd: int, position: int) -> None:
        count = value.shape[0] if value.dim() else 1
        nbytes = count * max(1, math.prod(tensor.shape[1:])) * tensor.dtype.itemsize
        stored = self._stored(fd, position, nbytes, "stored").view(tensor.dtype).view(value.shape)
        worst, off = _prove_block(tensor, start, value, stored, self._buffer("rounded", nbytes))
        with self._lock:
            before, before_off = self._results.get(tensor.name, (0.0, 0))
            self._results[tensor.name] = (max(before or 0.0, worst), before_off + off)

    def figures(self, output_dir: Path, identical: dict[str, str] | None = None) -> dict:
        """The figures of the proof taken while ``output_dir`` was written, once its stored
        tensors are the plan's (names, shapes, dtypes, shards)."""
        with CheckpointReader(output_dir) as output:
            check_inventory(self.plan, output)
        tensors = [tensor for group in tensors_by_shard(self.plan).values() for tensor in group]
        missing = [tensor.name for tensor in tensors if tensor.name not in self._results]
        if missing:
            raise AssertionError(f"the writer did not show the proof {missing[0]}")
        results = [(index, *self._results[tensor.name]) for index, tensor in enumerate(tensors)]
        return _figures(self.plan, tensors, results, identical)

    def _buffer(self, role: str, nbytes: int) -> torch.Tensor:
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = ScratchBuffers()
        return buffers(role, nbytes)

    def _stored(self, fd: int, position: int, nbytes: int, role: str) -> torch.Tensor:
        return safetensors_io.read_at(fd, position, self._buffer(role, nbytes))


def _figures(plan: ConversionPlan, tensors: list[TensorPlan], results: Iterable[tuple[int, float | None, int]],
             identical: dict[str, str] | None) -> dict:
    """Counts, the limit and the worst tensor of a proof's ``results``: (index into ``tensors``,
    ulps or None for a byte-identical tensor, elements not bit-exact), each tensor once.
    ``identical`` receives each byte-identical tensor: converted name -> source name."""
    counts = {"tensors": len(plan.tensors), "byte_identical": 0, "recomputed": 0}
    worst = {"tensor": None, "ulp": 0.0, "dtype": None, "elements_off_by_rounding": 0}
    for index, units, off in sorted(results, key=lambda result: result[0]):
        tensor = tensors[index]
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
        kept = ShardSource(source)
        return {name: tensor.source for name, tensor in plan.tensors.items() if kept.keeps_bytes(tensor)}


def rebuilt_conversion_plan(original_dir: Path, original_config: dict, options: dict,
                            stored: dict[str, TensorInfo]) -> ConversionPlan:
    """The plan a conversion ran, rebuilt from the original and the options its provenance
    records (``method``, ``fold_gains``, ``dtype``), planned from the adapter's declarations.
    The output dtype is the source's unless the stored tensors show a cast to the recorded dtype
    (``--dtype``), which then applies to every floating tensor."""

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
    from normswap.rotate.online import add_online_hadamard, check_spec
    from normswap.rotate.pipeline import planned_rotation, seeded_rotation

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
        units, differing = _prove_block(tensor, start, expected, stored, shared.buffer("rounded", nbytes))
        worst, off = max(worst, units), off + differing
    return worst, off


def _prove_block(tensor: TensorPlan, start: int, expected: torch.Tensor, stored: torch.Tensor,
                 buffer: torch.Tensor) -> tuple[float, int]:
    """(worst ulps, elements not bit-exact) of the ``stored`` rows from row ``start`` against
    ``expected``, their float64 plan value, rounded into ``buffer`` (uint8, the rows' bytes);
    raises ``VerificationError`` naming the first element beyond ``ULP_LIMIT`` or a finite value
    the output dtype cannot hold."""
    rounded = buffer.view(tensor.dtype).view(expected.shape)
    rounded.copy_(expected)  # rounded to nearest as ``Tensor.to`` rounds
    # finite when no value is NaN (which rounds to NaN) or rounds to infinity (aminmax of the
    # rounded values: one pass over the narrow dtype, no temporary)
    finite = not expected.numel() or all(math.isfinite(float(bound)) for bound in torch.aminmax(rounded))
    if not finite:
        _refuse_overflow(tensor, start, expected, rounded)
    elif torch.equal(_words(rounded), _words(stored)):  # bit-exact and finite
        return 0.0, 0
    differs = ~(rounded == stored)
    units = _units(stored[differs], rounded[differs], expected, tensor.dtype)
    if not bool((units <= ULP_LIMIT).all()):
        _refuse(tensor, start, differs, units, stored, expected)
    return (float(units.max()) if units.numel() else 0.0), int(differs.sum())


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
