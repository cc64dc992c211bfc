"""`treeattn generate` on a real cluster: torchrun, topology, dtype, device and sampling.

The options a production generator has, kept apart from the command's core
(:mod:`treeattn.commands.generate`):

* **torchrun**: started by ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
  ``MASTER_PORT`` set, no ``--nproc``) each process is one rank: it loads the model itself,
  once, joins the group (NCCL on CUDA with ``LOCAL_RANK``'s GPU, gloo on CPU) and runs
  :func:`treeattn.llm.generate_dist.rank_generate` in-process. Rank 0 streams and prints;
  the other ranks print nothing. ``python -m treeattn generate ...`` is the entry point.
* ``--topology SPEC|FILE``: the cluster the plan is made for (``--algorithm auto`` asks the
  planner on it); its GPU count must equal the world size.
* ``--dtype`` and ``--device``: where the weights live (:mod:`treeattn.llm.options`).
* ``--temperature``, ``--top-k``, ``--top-p``, ``--seed``: sampling; temperature 0 (the
  default) is greedy and exactly what the command did before.
"""

from __future__ import annotations

import argparse
import os

from treeattn import testbed
from treeattn.errors import UserError


def add_cluster_options(parser: argparse.ArgumentParser) -> None:
    """The flags of this module, added to ``generate``'s parser."""
    parser.add_argument("--topology", default=None, metavar="SPEC|FILE",
                        help="the cluster to plan for (e.g. dgx-h100:nodes=2 or a topology "
                             "file); its GPU count must equal the world size")
    parser.add_argument("--profile", default=None, metavar="PROFILE.json",
                        help="with --algorithm auto: price the algorithms with this "
                             "calibration (`treeattn calibrate -o`, best with the model's head "
                             "shape) instead of the uncalibrated defaults")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="fp32",
                        help="weights of the transformer blocks and the KV cache (default "
                             "fp32); embeddings, logits and attention accumulate in fp32")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where each rank runs (default auto: its GPU if CUDA is there)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature (default 0: greedy)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample among the k most likely tokens (default 0: all)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample among the most likely tokens holding this much "
                             "probability (default 1: all)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the sampler (rank 0's); default: a random one, "
                             "reported with --json")


def torchrun_mode(args: argparse.Namespace) -> bool:
    """Whether this process is one rank of a torchrun group (and was not given --nproc)."""
    from treeattn.runtime.group import in_torchrun_env

    return in_torchrun_env() and args.nproc is None


def world_size(args: argparse.Namespace) -> int:
    """The number of ranks: torchrun's ``WORLD_SIZE``, else ``--nproc`` (default 2)."""
    from treeattn.runtime.launch import check_world

    if torchrun_mode(args):
        try:
            world = int(os.environ["WORLD_SIZE"])
        except ValueError:
            raise UserError(f"WORLD_SIZE is not an integer: {os.environ['WORLD_SIZE']!r}") from None
        if world < 1:
            raise UserError(f"WORLD_SIZE must be at least 1, got {world}")
        return world
    world = 2 if args.nproc is None else args.nproc
    check_world(world)
    return world


def sampling_of(args: argparse.Namespace):
    """The checked :class:`~treeattn.llm.options.Sampling`, with a seed when it samples."""
    from treeattn.llm.options import Sampling

    return Sampling(args.temperature, args.top_k, args.top_p, args.seed).check().seeded()


def check_placement(args: argparse.Namespace) -> None:
    """One-line errors for an unknown dtype or device, or ``--device cuda`` without CUDA."""
    from treeattn.llm.options import check_device, dtype_of

    dtype_of(args.dtype)
    check_device(args.device)


def topology_for(args: argparse.Namespace, world: int):
    """The :class:`~treeattn.topo.Topology` of ``--topology`` (None without it).

    Raises UserError unless it has exactly ``world`` GPUs: the plan's ranks are its GPUs.
    """
    if args.topology is None:
        return None
    from treeattn.topo import Topology

    topology = Topology.load(args.topology)
    if topology.num_gpus != world:
        raise UserError(f"topology {args.topology} has {topology.num_gpus} GPUs, but the world "
                        f"size is {world}")
    return topology


def placed(loaded, args: argparse.Namespace):
    """``loaded``'s model, placed on this process's device in ``--dtype`` (for one process or
    the ``--verify`` reference)."""
    from treeattn.llm.options import dtype_of, local_device, place_model

    return place_model(loaded.model, local_device(args.device), dtype_of(args.dtype))


def run_torchrun(request, args: argparse.Namespace, loaded) -> tuple[bool, dict]:
    """Run ``request`` as this torchrun rank; returns ``(is rank 0, this rank's result)``.

    A lost or hung peer raises RankLost/RankTimeout (one ``error:`` line, exit 1).
    """
    from functools import partial

    from treeattn.llm.generate_dist import rank_generate
    from treeattn.runtime.launch import LaunchOptions, run_in_group

    testbed.plug_in()  # CPU ranks of one host: the shared-memory transport
    options = LaunchOptions(timeout_s=args.timeout, threads=1, device=args.device)
    ctx, result = run_in_group(partial(rank_generate, request=request, loaded=loaded), options)
    return ctx.rank == 0, result


def rank_of_this_process() -> int:
    """This process's torchrun rank (0 outside torchrun)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
