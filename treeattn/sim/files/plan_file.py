"""Plan files (``treeattn plan -o``) read back and checked in full before any rank starts.

A plan file is data someone may have sent: ``run --plan`` and ``generate --plan`` execute
its schedule on real ranks, and the simulator prices what it declares. So everything it says
is checked here, in one place, before anything is allocated or started:

* the header: ``format``/``version``, a known ``model`` (a registry name, or ``NAME/tpN`` for
  one tensor-parallel group's share of the heads), integer ``seq_len`` and ``batch`` in range,
  ``shard_lengths`` that are one non-negative integer per rank of the schedule and sum to
  ``seq_len``, an ``algorithm`` that is the schedule's, and a ``layout`` its output serves
  (a replicated output serves a head-sharded request too);
* the schedule, strictly (:func:`treeattn.sim.files.export.schedule_from_json`): every field's type
  and range, ranks, tags, payload names, chunk bounds, collective groups and their order,
  merges, and a static deadlock check (a symbolic run in which every Recv must meet its Send
  and every collective all its members; a schedule that would wait forever is refused with
  the ranks and steps named);
* every size it declares against the workload's real ones (:func:`check_sizes`): a message
  must be exactly the size of the buffer (or chunk) it names for this model, batch and
  shards, an attention exactly the bytes and FLOPs of its shard, and the remaining compute
  and merges within a bound of the buffers they touch. A plan claiming 10^15-byte messages,
  or 64 MiB for a 272-byte partial, is refused instead of being priced as it says.

Plain data: no torch. The runtime adds the memory check (the plan's shards must fit).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from treeattn.inputs import Fields, InputError, read_json
from treeattn.schedule.ir import OUTPUT_LAYOUTS, Collective, Compute, Merge, Recv, Schedule, Send
from treeattn.schedule.payloads import PAYLOAD_LAYOUTS, SimError, element_bytes, shard_sizes
from treeattn.schedule.workload import MODELS, DecodeWorkload, ModelConfig
from treeattn.sim.files.export import MAX_WORLD, check_tag, schedule_from_json

MAX_PLAN_BYTES = 256 << 20  # a 16k-rank tree's plan is a few MB; anything far larger is junk
MAX_SEQ_LEN = 1 << 40
MAX_BATCH = 1 << 16


@dataclass(frozen=True)
class PlanFile:
    """A checked plan: its schedule, the workload it was made for, and the raw header."""

    schedule: Schedule
    workload: DecodeWorkload
    record: dict
    source: str

    @property
    def model(self) -> ModelConfig:
        return self.workload.model

    @property
    def shard_lengths(self) -> tuple[int, ...]:
        return tuple(self.workload.shard_lengths)


def read_plan(path: str | os.PathLike) -> PlanFile:
    """Read and check the plan file at ``path`` (a regular file of bounded size)."""
    return plan_from_json(read_json(path, "plan", MAX_PLAN_BYTES), f"plan {path}")


def model_of(name: str, source: str) -> ModelConfig:
    """The model a plan names: a registry model, or ``NAME/tpN`` (one TP group's heads)."""
    base, _, tp = name.partition("/tp")
    key = base.strip().lower()
    if key not in MODELS or (tp and not (tp.isascii() and tp.isdigit() and 1 < int(tp) <= 1024)):
        raise InputError(f"{source}: field model: expected a known model (one of "
                         f"{', '.join(MODELS)}, optionally /tpN), got {name[:60]!r}")
    if not tp:
        return MODELS[key]
    from treeattn.sim.parallel import group_workload

    try:
        return group_workload(DecodeWorkload(MODELS[key], 1, tp=int(tp))).model
    except SimError as exc:
        raise InputError(f"{source}: field model: {exc}") from None


def plan_from_json(data, source: str = "plan") -> PlanFile:
    """Check a parsed plan file (see the module docstring); InputError or SimError naming
    the file and the field otherwise."""
    try:
        check_tag(data, "plan", source)
    except SimError as exc:
        raise InputError(str(exc)) from None
    f = Fields(data, source)
    model = model_of(f.string("model"), source)
    seq_len = f.integer("seq_len", 1, MAX_SEQ_LEN)
    batch = f.integer("batch", 1, MAX_BATCH, required=False, default=1)
    layout = f.string("layout", OUTPUT_LAYOUTS, required=False, default="replicated")
    lengths = f.numbers("shard_lengths", 0, seq_len, MAX_WORLD, integer=True, min_len=1)
    if sum(lengths) != seq_len:
        f.fail("shard_lengths", f"lengths that sum to seq_len {seq_len}",
               got=f"a sum of {sum(lengths)}")
    schedule = schedule_from_json(f.raw("schedule"), f"{source} (schedule)")
    if len(lengths) != schedule.world:
        f.fail("shard_lengths", f"one length per rank of the schedule ({schedule.world})",
               got=f"{len(lengths)}")
    if f.has("algorithm") and f.raw("algorithm") != schedule.algorithm:
        f.fail("algorithm", f"the schedule's algorithm {schedule.algorithm!r}",
               f.raw("algorithm"))
    if layout != schedule.output_layout and schedule.output_layout != "replicated":
        # a replicated output also serves a head-sharded request; the reverse is wrong
        f.fail("layout", f"the schedule's output layout {schedule.output_layout!r}", layout)
    workload = DecodeWorkload(model, seq_len, batch=batch, shard_lengths=tuple(lengths),
                              layout=layout, partial_dtype=schedule.partial_dtype)
    check_sizes(schedule, workload, source)
    return PlanFile(schedule, workload, data, source)


# -- sizes -----------------------------------------------------------------------------------

def _element(workload: DecodeWorkload, payload: str) -> int:
    return element_bytes(PAYLOAD_LAYOUTS[payload], 0, workload.model.dtype_bytes,
                         workload.wire_dtype)


def message_sizes(workload: DecodeWorkload, payload: str, chunk, world: int) -> set[int]:
    """Every size a message of ``payload`` (or its ``chunk``) can have in ``workload``:
    one size for a fixed buffer, one per distinct shard length for a KV block."""
    if payload == "kv":
        wholes = {workload.kv_bytes(t) for t in set(workload.shard_lengths)}
        if chunk is None:
            return wholes
        return {4 * shard_sizes(n // 4, chunk[1])[chunk[0]] for n in wholes} | {
            workload.model.dtype_bytes * shard_sizes(n // workload.model.dtype_bytes,
                                                     chunk[1])[chunk[0]] for n in wholes}
    whole = workload.buffer_bytes(payload, world)
    if chunk is None:
        return {whole}
    index, count = chunk
    axis = PAYLOAD_LAYOUTS[payload].chunk_axis
    if axis == "Hq":
        return {workload.chunk_bytes(payload, count)[index]}
    if axis == "P":
        return {whole // world * shard_sizes(world, count)[index]}
    item = _element(workload, payload)
    return {item * shard_sizes(whole // item, count)[index]}


def _largest_buffer(workload: DecodeWorkload, world: int) -> int:
    return max(workload.buffer_bytes(p, world) for p in PAYLOAD_LAYOUTS if p != "kv")


def check_sizes(schedule: Schedule, workload: DecodeWorkload, source: str) -> None:
    """Refuse a schedule whose declared sizes are not this workload's real ones (module
    docstring), naming the rank, the step, the declared and the expected size."""
    world = schedule.world
    lengths = workload.shard_lengths
    big = _largest_buffer(workload, world)
    flops_cap = 2 * workload.attention_flops(workload.seq_len) + 1

    def refuse(r: int, i: int, step, expected: str) -> None:
        raise InputError(f"{source}: field schedule.steps[{r}][{i}] ({type(step).__name__} "
                         f"{getattr(step, 'label', '') or getattr(step, 'payload', '')}): "
                         f"expected {expected}, got {step.nbytes} bytes")

    attention = {t: workload.attention_step(t) for t in set(lengths)}
    for r, steps in enumerate(schedule.steps):
        for i, step in enumerate(steps):
            if isinstance(step, Send | Recv):
                sizes = message_sizes(workload, str(step.payload), step.chunk, world)
                if step.nbytes not in sizes:
                    refuse(r, i, step, f"{' or '.join(map(str, sorted(sizes)[:4]))} bytes "
                                       f"(the real {step.payload} for this model and shards)")
            elif isinstance(step, Collective):
                whole = workload.buffer_bytes(str(step.payload), world)
                sizes = {whole, len(step.group) * whole}
                if str(step.payload) == "num":  # DCP moves it in the attention dtype, as vLLM
                    sizes.add(whole // 4 * workload.model.dtype_bytes)
                if step.nbytes not in sizes:
                    refuse(r, i, step, f"{whole} or {len(step.group) * whole} bytes (the "
                                       f"real {step.payload} buffer, or the group's)")
            elif isinstance(step, Compute):
                if step.label == "attention":
                    real = attention[lengths[r]]
                    if (step.nbytes, step.flops) != (real.nbytes, real.flops):
                        refuse(r, i, step, f"{real.nbytes} bytes and {real.flops} FLOPs (an "
                                           f"attention over its {lengths[r]} tokens)")
                elif step.label == "attention_block":
                    if step.nbytes not in {a.nbytes for a in attention.values()}:
                        refuse(r, i, step, "the bytes of an attention over one shard")
                elif step.label == "attention_qblock":
                    # every origin's block: one with no real query slot costs 0 bytes
                    real = {workload.qblock_attention_step(t, world, origin).nbytes
                            for t in set(lengths) for origin in range(world)}
                    if step.nbytes not in real:
                        refuse(r, i, step, "the bytes of a pass-Q attention over one shard")
                elif step.nbytes > 8 * big:
                    refuse(r, i, step, f"at most {8 * big} bytes (8x the largest buffer)")
                if step.flops > flops_cap:
                    raise InputError(f"{source}: field schedule.steps[{r}][{i}]: expected at "
                                     f"most {flops_cap} FLOPs, got {step.flops}")
            elif isinstance(step, Merge) and step.nbytes > 3 * world * big:
                refuse(r, i, step, f"at most {3 * world * big} bytes (3 x world x the largest "
                                   "buffer)")
