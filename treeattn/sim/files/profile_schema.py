"""The stated schema of a calibration profile, and the one validating reader of it.

A profile drives every prediction, and it may come from someone else's machine. So every
field the simulator reads is checked here, once, before anything is priced: a JSON number
(never the string ``"12"``, never ``true``) where a number belongs, finite, within a
physical range, required keys present. Unknown keys are kept (newer writers may add some);
known keys of the wrong type are refused with the file, the field and what was expected.

Schema, version 1 (``[lo, hi]``: the accepted range; ``?``: optional)::

    format?  "treeattn.profile"          version  1
    kind?    "nccl-tests"                (absent: this host's CPU ranks, ``calibrate``)
    backend  "gloo" | "nccl" | "rccl" | ...   (a known backend model)
    world    integer [1, 131072]         cores    integer [1, 65536]  (CPU profiles)
    pinned?  bool                        transport? string
    p2p      {latency_s [0, 10], bandwidth_Bps (0, 1e13], sizes? times_s? p10_s? p90_s?
              latency_spread? bandwidth_spread?}
    exchange? like p2p, plus aggregate_Bps? (0, 1e14], ranks? integer
    allreduce? {latency_s? [0, 10], sizes?, times_s?}
    collectives? {world integer, OP: {alpha_s [0, 10], seconds_per_byte [0, 1], sizes?,
                  times_s?, spread?}}
    attention {bandwidth_Bps (0, 1e14], launch_s [0, 10], flops_per_s? (0, 1e18],
               threads_per_rank? [1, 4096], concurrent_ranks?, sizes?, times_s?, spread?}
    executor? {step_overhead_s [0, 1], program_step_s? [-1, 1], program_message_bytes?
               [1, 2^40], program_tags? [1, 2^20], program_max_world? [2, 131072]}
    cold?    {merge_s?, message_s? [0, 10], collectives_s? {OP: [0, 10]}, world? integer,
              after_bytes? [0, 1e15]}
    machine? an object (where it was measured: host, CPU, versions; informational)

    GPU clusters (``kind: "nccl-tests"``, from ``calibrate --nccl-tests``): backend, world
    [2, 131072], topology (the spec it was measured on), gpu_model? and hosts? (what it
    describes; written since this version, checked against the topology it is used with),
    nccl_tests {world, scales {lat, bw, ...: (0, 1e6]}, tables {OP: {sizes: increasing
    integers [1, 2^50], times_s: (0, 1e6]}}, residuals?, sources?}

sizes, times and spreads are lists of at most 64 numbers: sizes in [0, 1e15] bytes, times in
(0, 1e4] seconds, a spread two factors in (0, 1e6].
"""

from __future__ import annotations

from treeattn.inputs import Fields, InputError

MAX_WORLD = 1 << 17
MAX_SAMPLES = 64
TIME = (0.0, 1e4)
SIZES = (0.0, 1e15)
SPREAD = (1e-12, 1e6)
NCCL_TESTS_KIND = "nccl-tests"
KERNELS_KIND = "kernels"  # a GPU's measured kernel table (calibrate --kernels)
KERNEL_TABLE_KINDS = ("gemm", "attention")  # treeattn.sim.deploy.kernel_table's rows
KERNEL_FIXED_S = (0.0, 10.0)  # a kernel fit's fixed cost, seconds: [lo, hi]
KERNEL_BYTES_PER_S = (0.0, 1e14)  # a kernel fit's HBM rate, bytes/s: (lo, hi]
KNOWN_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
             "sendrecv")


def _series(f: Fields, *keys: str) -> None:
    for key in keys:
        if key == "sizes":
            f.numbers(key, *SIZES, MAX_SAMPLES, required=False)
        elif key.endswith("spread"):
            f.numbers(key, *SPREAD, 2, required=False, min_len=2)
        else:  # times_s, p10_s, p90_s: a measured time is positive
            for i, t in enumerate(f.numbers(key, *TIME, MAX_SAMPLES, required=False) or []):
                if t <= 0:
                    f.fail(f"{f.where(key)}[{i}]", "a positive time in seconds", t)
    sizes, times = f.data.get("sizes"), f.data.get("times_s")
    if sizes is not None and times is not None and len(sizes) != len(times):
        f.fail(f.where("times_s"), f"one time per size ({len(sizes)})", got=f"{len(times)}")


def _link(f: Fields, required: bool) -> None:
    f.number("latency_s", 0.0, 10.0, required=required)
    f.number("bandwidth_Bps", 0.0, 1e13, required=required, lo_open=True)
    _series(f, "sizes", "times_s", "p10_s", "p90_s", "latency_spread", "bandwidth_spread")


def check_profile(data, source: str) -> dict:
    """Return ``data`` if it is a valid profile (the module's schema), else InputError."""
    from treeattn.sim.devices import BACKENDS

    f = Fields(data, source)
    f.string("format", ("treeattn.profile",), required=False)
    if f.raw("version", required=False) != 1:
        f.fail("version", "1", f.raw("version", required=False),
               got=None if f.has("version") else "nothing (it is missing)")
    kind = f.string("kind", (NCCL_TESTS_KIND, KERNELS_KIND), required=False)
    f.string("backend", tuple(BACKENDS), required=kind is not None,
             default="gloo")
    if kind == NCCL_TESTS_KIND:
        _check_cluster(f)
        return data
    if kind == KERNELS_KIND:
        _check_kernels(f)
        return data
    f.integer("world", 1, MAX_WORLD)
    f.integer("cores", 1, 1 << 16)
    f.boolean("pinned", required=False)
    f.string("transport", required=False)
    _link(f.obj("p2p"), True)
    if (exchange := f.obj("exchange", required=False)) is not None:
        _link(exchange, False)
        exchange.number("aggregate_Bps", 0.0, 1e14, required=False, lo_open=True)
        exchange.integer("ranks", 1, MAX_WORLD, required=False)
    if (allreduce := f.obj("allreduce", required=False)) is not None:
        allreduce.number("latency_s", 0.0, 10.0, required=False)
        _series(allreduce, "sizes", "times_s")
    if (collectives := f.obj("collectives", required=False)) is not None:
        collectives.integer("world", 1, MAX_WORLD)
        for op in collectives.data:
            if op != "world":
                fit = collectives.obj(op)
                fit.number("alpha_s", 0.0, 10.0)
                fit.number("seconds_per_byte", 0.0, 1.0)
                _series(fit, "sizes", "times_s", "spread")
    attention = f.obj("attention")
    attention.number("bandwidth_Bps", 0.0, 1e14, lo_open=True)
    attention.number("launch_s", 0.0, 10.0)
    attention.number("flops_per_s", 0.0, 1e18, required=False, lo_open=True)
    attention.integer("threads_per_rank", 1, 4096, required=False)
    attention.integer("concurrent_ranks", 1, MAX_WORLD, required=False)
    _series(attention, "sizes", "times_s", "spread")
    if (executor := f.obj("executor", required=False)) is not None:
        executor.number("step_overhead_s", 0.0, 1.0)
        if executor.has("program_step_s"):
            executor.number("program_step_s", -1.0, 1.0)
            executor.integer("program_message_bytes", 1, 1 << 40)
            executor.integer("program_tags", 1, 1 << 20)
            executor.integer("program_max_world", 2, MAX_WORLD)
    if (cold := f.obj("cold", required=False)) is not None:
        cold.number("merge_s", 0.0, 10.0, required=False)
        cold.number("message_s", 0.0, 10.0, required=False)
        cold.integer("world", 0, MAX_WORLD, required=False)
        cold.number("after_bytes", *SIZES, required=False)
        if (costs := cold.obj("collectives_s", required=False)) is not None:
            for op in costs.data:
                costs.number(op, 0.0, 10.0)
    f.obj("machine", required=False)
    return data


def _check_cluster(f: Fields) -> None:
    """The nccl-tests calibration of a GPU cluster (see the module docstring)."""
    f.integer("world", 2, MAX_WORLD)
    f.string("topology", max_len=4096)
    f.string("gpu_model", required=False)
    f.integer("hosts", 1, MAX_WORLD, required=False)
    if (env := f.obj("nccl_env", required=False)) is not None:  # what the run was started with
        from treeattn.sim.nccl.env import NCCL_ENV

        for name in env.data:
            if name not in NCCL_ENV:
                env.fail(env.where(name), "a variable the cost model reads ("
                         + ", ".join(NCCL_ENV) + ")", got=f"the key {name[:40]!r}")
            env.string(name, NCCL_ENV[name][0])
    section = f.obj("nccl_tests")
    section.integer("world", 2, MAX_WORLD)
    from treeattn.sim.nccl.fit import SCALE_NAMES

    scales = section.obj("scales")
    for name in {*SCALE_NAMES, *scales.data}:
        scales.number(name, 0.0, 1e6, lo_open=True)
    tables = section.obj("tables")
    for op in tables.data:
        if op not in KNOWN_OPS:
            tables.fail(tables.where(op), "an op name (" + ", ".join(KNOWN_OPS) + ")",
                        got=f"the key {op[:40]!r}")
        table = tables.obj(op)
        sizes = table.numbers("sizes", 1, 2**50, 4096, integer=True, min_len=1)
        times = table.numbers("times_s", 1e-12, 1e6, 4096, min_len=1)
        if len(times) != len(sizes):
            table.fail(table.where("times_s"), f"one time per size ({len(sizes)})",
                       got=f"{len(times)}")
        if any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
            table.fail(table.where("sizes"), "strictly increasing sizes", got="a repeat or a "
                       "decrease")
    section.array("residuals", 1 << 16, required=False)
    section.array("sources", 1 << 12, required=False)
    if section.data["world"] != f.data["world"]:
        section.fail(section.where("world"), f"the profile's world {f.data['world']}",
                     section.data["world"])


def _check_kernels(f: Fields) -> None:
    """A GPU's fitted kernel table (``calibrate --kernels``): its GPU model and one fit per
    kind of kernel (see :mod:`treeattn.sim.deploy.kernel_table`)."""
    f.string("gpu_model", max_len=256)
    section = f.obj("kernels")
    section.string("source", max_len=4096, required=False)
    fits = section.array("fits", 64, min_len=1)
    for i, item in enumerate(fits):
        fit = Fields(item, f.source, section.where("fits") + f"[{i}]")
        fit.string("kind", KERNEL_TABLE_KINDS)
        fit.string("dtype", max_len=16)
        fit.number("fixed_s", *KERNEL_FIXED_S)
        fit.number("bytes_per_s", *KERNEL_BYTES_PER_S, lo_open=True)
        fit.integer("points", 2, 1 << 20)


def describe_mismatch(profile: dict, gpu_model: str, hosts: int, gpus: int) -> str | None:
    """Why ``profile`` does not describe a topology of ``gpus`` ``gpu_model`` GPUs on
    ``hosts`` hosts, as ``field F: expected X, got Y`` (None when it does, or when the
    profile does not say)."""
    if profile.get("kind") == KERNELS_KIND:  # a GPU's kernels, whatever the group
        said = str(profile.get("gpu_model", ""))
        if said.lower() != gpu_model.lower():
            return (f"field gpu_model: expected {gpu_model}, got {said} (its kernels were "
                    f"measured on {said} GPUs)")
        return None
    if profile.get("kind") != NCCL_TESTS_KIND:
        if gpu_model.lower() != "cpu":
            return (f"field kind: expected {NCCL_TESTS_KIND!r} (a calibration of {gpu_model} "
                    f"GPUs), got a calibration of this host's CPU ranks "
                    f"({profile.get('backend', 'gloo')})")
        return None
    from treeattn.sim.devices import default_backend

    if profile["world"] != gpus:
        return (f"field world: expected the topology's {gpus} GPUs, got {profile['world']} "
                f"(it was calibrated on {profile['world']} GPUs)")
    said = profile.get("gpu_model")
    if said is not None and said.lower() != gpu_model.lower():
        return f"field gpu_model: expected {gpu_model}, got {said} (it describes {said} GPUs)"
    if profile.get("hosts") is not None and profile["hosts"] != hosts:
        return f"field hosts: expected {hosts}, got {profile['hosts']}"
    expected = default_backend(gpu_model).name
    if profile["backend"] != expected:
        return (f"field backend: expected {expected} (what {gpu_model} GPUs run), got "
                f"{profile['backend']}")
    return None


def refuse_if_foreign(profile: dict, topology, source: str = "calibration profile") -> None:
    """InputError when ``profile`` describes another kind of machine than ``topology``."""
    gpus = topology.num_gpus
    hosts = len({topology.host_of(i) for i in range(gpus)})
    why = describe_mismatch(profile, topology.gpu_model(0), hosts, gpus)
    if why is not None:
        raise InputError(f"{source}: not for topology {topology.name or 'given'}: {why}")
