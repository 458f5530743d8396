"""The process grid: world = depth (stages) x width (data-parallel replicas).

By default consecutive ranks form one pipeline (rank = replica * num_stages + stage), so stage-to-stage traffic
stays inside a node and the replicas of one stage reduce gradients across nodes; ``placement="replicas"`` puts a
stage's replicas on consecutive ranks instead (rank = stage * width + replica: the reduce inside a node, the
pipeline across nodes, as Megatron-LM orders data parallelism inside pipeline parallelism). ``layout.Placement``
states the rule once; the grid, the communicators and the planner read it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..layout import Placement, width_of
from .transport import LinkChannels


@dataclass
class ProcessGrid:
    rank: int
    world_size: int
    num_stages: int
    placement: Placement = Placement.PIPELINE  # or its value
    data_parallel_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.data_parallel_size = width_of(self.world_size, self.num_stages)
        self.placement = Placement(self.placement)

    def rank_at(self, stage: int, replica: int) -> int:
        return self.placement.rank(stage, replica, self.num_stages, self.data_parallel_size)

    @property
    def stage(self) -> int:
        return self.placement.position(self.rank, self.num_stages, self.data_parallel_size)[0]

    @property
    def replica(self) -> int:
        return self.placement.position(self.rank, self.num_stages, self.data_parallel_size)[1]

    def pipeline_ranks(self, replica: int | None = None) -> list[int]:
        replica = self.replica if replica is None else replica
        return [self.rank_at(s, replica) for s in range(self.num_stages)]

    def replica_ranks(self, stage: int | None = None) -> list[int]:
        stage = self.stage if stage is None else stage
        return [self.rank_at(stage, r) for r in range(self.data_parallel_size)]

    @property
    def prev_rank(self) -> int | None:
        return self.rank_at(self.stage - 1, self.replica) if self.stage > 0 else None

    @property
    def next_rank(self) -> int | None:
        return self.rank_at(self.stage + 1, self.replica) if self.stage < self.num_stages - 1 else None

    def rank_of(self, stage: int) -> int:
        return self.rank_at(stage, self.replica)

    def describe(self, rank: int | None = None) -> str:
        """``rank`` (default: this one) as a person reads it: its stage and replica."""
        rank = self.rank if rank is None else rank
        stage, replica = self.placement.position(rank, self.num_stages, self.data_parallel_size)
        return f"rank {rank} (stage {stage} of {self.num_stages}, replica {replica})"


@dataclass
class Groups:
    """Process groups this rank belongs to (``build_groups``). Every rank takes part in creating every group, in the
    same order; a rank outside a group keeps nothing of it (no process group, no communicator). Not
    ``use_local_synchronization``: its group names hash the ranks with how many groups the creating rank holds, which
    differs between the stages of a pipeline (a middle stage has two links), so members would not meet. ``mesh``
    gives the replica and pipeline groups as a ``DeviceMesh`` (dimensions ``dp`` and ``pp``) for composing with FSDP2
    or tensor parallelism as torchtitan's meshes do.

    ``pipeline``: the stages of one replica (global clip norm, non-finite agreement, evaluation results);
    ``loss``: the same ranks, for the asynchronous loss broadcast (its own communicator, so it never queues
    behind an update's collective); ``replica``: one stage's data-parallel replicas (gradient averaging);
    ``shared``: the stages holding a tied parameter; ``link``: one group per neighbour, both directions, used in
    batches (``transport.py`` says why); ``shard``: the same ranks as ``replica``, for the sharded optimizer's
    weight broadcasts (``sharding.py``; its own communicator, so they never queue behind the next batch's gradient
    all-reduce, which is in flight on ``replica`` when they are issued). None at width 1.
    """

    pipeline: object
    loss: object
    replica: object
    shared: dict[tuple[int, ...], object]
    link: LinkChannels = field(default_factory=LinkChannels)
    shard: object = None

    def mesh(self, device_type: str, num_stages: int, width: int) -> DeviceMesh:
        """The run's ranks as a ``DeviceMesh`` of shape ``(width, num_stages)``, dimensions ``("dp", "pp")``, over
        this rank's own replica and pipeline groups (``DeviceMesh.from_group``: no new communicator)."""
        layout = torch.arange(width * num_stages).view(width, num_stages)
        return DeviceMesh.from_group(
            [self.replica, self.pipeline], device_type, mesh=layout, mesh_dim_names=("dp", "pp")
        )

    def members(self) -> list[object]:
        """Every group this rank belongs to, once each, ordered by the group's name (the same order on every rank
        of a group: how ``destroy`` releases them)."""
        held = [self.pipeline, self.loss, self.replica, self.shard, *self.shared.values(), *vars(self.link).values()]
        outside = (None, dist.GroupMember.NON_GROUP_MEMBER, dist.GroupMember.WORLD)
        unique = {id(g): g for g in held if not any(g is o for o in outside)}
        return sorted(unique.values(), key=lambda g: g.group_name)

    def destroy(self) -> None:
        """Destroy every group of ``members`` (their threads, sockets and communicators). Call on every rank, once
        nothing is in flight on them; the handles are unusable afterwards."""
        for group in self.members():
            dist.destroy_process_group(group)


COMMUNICATORS = ("pipeline", "loss", "replica", "shard", "tied", "p2p", "ring")
HOST = " (host)"  # ends the name of a gloo group over CPU tensors: its collectives never enter a device's queue
STOP_FLAG_GROUP = f"pd2bw/preemption{HOST}"  # the world's stop agreement, on every backend (lightning/preemption.py)


def communicator(
    name: str,
    stage: int,
    replica: int,
    num_stages: int,
    width: int,
    tied: Sequence[int] = (),
    placement: Placement = Placement.PIPELINE,
) -> tuple[str, tuple[int, ...]]:
    """The name (``group_desc``) and ranks of ``stage``'s communicator ``name`` in ``replica``: the one naming
    ``build_groups``, the NCCL lowering (``verify/comm_plan.py``) and the planner's simulator read. ``pipeline`` and
    ``loss``: the replica's stages; ``replica`` and ``shard``: the stage's replicas; ``tied``: the replica's stages
    ``tied`` (holding one tied parameter); ``p2p``: stages ``stage`` and ``stage + 1`` of the replica; ``ring``: the
    replica's stages, for interleaved 1F1B's messages (one batch per tick over the ring: ``schedules/lockstep.py``)."""
    at = Placement(placement).rank
    in_replica = tuple(at(s, replica, num_stages, width) for s in range(num_stages))
    if name in ("pipeline", "loss", "ring"):
        return f"pd2bw/{name}/replica{replica}", in_replica
    if name in ("replica", "shard"):
        return f"pd2bw/{name}/stage{stage}", tuple(at(stage, r, num_stages, width) for r in range(width))
    if name == "tied":
        return f"pd2bw/shared/replica{replica}/stages{'-'.join(map(str, tied))}", tuple(in_replica[s] for s in tied)
    if name == "p2p":
        return f"pd2bw/p2p/replica{replica}/stage{stage}-{stage + 1}", (in_replica[stage], in_replica[stage + 1])
    raise ValueError(f"no communicator {name!r}; one of {COMMUNICATORS}")


def end_default_group() -> None:
    """Destroy the default process group if one is up: a program that exits without it can abort in gloo's threads
    at interpreter shutdown ("terminate called without an active exception", SIGABRT) while pending work still holds
    tensors (pytorch/pytorch#190489). Lightning's strategies leave the group up after ``fit``; the program ends it."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def group_kinds(
    grid: ProcessGrid, shared_stage_sets: Sequence[tuple[int, ...]], ring: bool = False
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Every group of the run as (name, ranks), by kind: the pipeline and loss groups of every replica, each link
    between stages s and s + 1 (``ring``: instead, the ring's group of every replica), the replica and shard groups of every stage, each tied stage set's groups. The groups of one kind never share a
    rank (what one ``split_group`` call needs); every rank lists them in the same order."""
    d, width = grid.num_stages, grid.data_parallel_size

    def kind(name: str, stages: Sequence[int] = (0,), replicas: Sequence[int] = (0,), tied=()) -> list:
        return [communicator(name, s, r, d, width, tied, grid.placement) for s in stages for r in replicas]

    everyone = range(width)
    kinds = [kind("pipeline", replicas=everyone), kind("loss", replicas=everyone)]
    if ring:  # interleaved 1F1B: one group per replica carries every message of its ring
        kinds.append(kind("ring", replicas=everyone))
    else:
        kinds += [kind("p2p", stages=[stage], replicas=everyone) for stage in range(d - 1)]
    kinds += [kind("replica", stages=range(d))] + ([kind("shard", stages=range(d))] if width > 1 else [])
    kinds += [kind("tied", replicas=everyone, tied=stages) for stages in dict.fromkeys(shared_stage_sets)]
    return kinds


def eager_nccl() -> bool:
    """Whether the default group is NCCL started eagerly (bound to a device: how the strategy starts it on GPUs),
    where ``split_group`` can make groups from its communicator."""
    return dist.get_backend() == "nccl" and dist.distributed_c10d._get_default_group().bound_device_id is not None


def build_groups(
    grid: ProcessGrid, shared_stage_sets: Sequence[tuple[int, ...]], split: bool | None = None, ring: bool = False
) -> Groups:
    """This rank's groups. Under an eagerly started NCCL (the default group bound to a device: how the strategy starts
    it on GPUs), one ``split_group`` per kind, one ``ncclCommSplit`` of the world each, as ``DeviceMesh`` creates
    its dimensions (at 64 ranks 8 splits where a ``new_group`` per group would be about 100, each of which every
    rank, member or not, joins); elsewhere a ``new_group`` per group, which leaves nothing on a rank outside it.
    ``split``: which of the two (None: ``eager_nccl()``); ``ring``: the stages' links close a ring (interleaved 1F1B:
    the last stage sends on to the first), all over the replica's ring group, both directions."""
    split = eager_nccl() if split is None else split
    mine: dict[str, object] = {}
    for groups in group_kinds(grid, shared_stage_sets, ring):
        own = next(((desc, ranks) for desc, ranks in groups if grid.rank in ranks), None)
        if split:
            group = dist.split_group(split_ranks=[list(r) for _, r in groups], group_desc=own[0] if own else None)
        else:
            made = [dist.new_group(list(ranks), group_desc=desc) for desc, ranks in groups]
            group = made[groups.index(own)] if own else None
        if own:
            mine[own[0]] = group
    d, width = grid.num_stages, grid.data_parallel_size

    def held(name: str, stage: int = grid.stage, tied: Sequence[int] = ()) -> object:
        return mine.get(communicator(name, stage, grid.replica, d, width, tied, grid.placement)[0])

    if ring:
        links = dict.fromkeys(("previous", "next"), held("ring"))
    else:
        links = {"previous": held("p2p", grid.stage - 1) if grid.stage > 0 else None}
        links["next"] = held("p2p") if grid.stage < d - 1 else None
    shared = {stages: held("tied", tied=stages) for stages in dict.fromkeys(shared_stage_sets) if grid.stage in stages}
    return Groups(
        held("pipeline"),
        held("loss"),
        held("replica"),
        shared,
        LinkChannels(**links),
        held("shard"),
    )


def default_device() -> torch.device:
    """This rank's GPU where CUDA is available (``visible_gpu`` of ``LOCAL_RANK``), else the CPU."""
    if torch.cuda.is_available():
        return visible_gpu(int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def visible_gpu(local_rank: int) -> torch.device:
    """``cuda:local_rank`` where the process sees its node's GPUs, ``cuda:0`` where it sees one: SLURM's
    ``--gpus-per-task=1`` (or ``CUDA_VISIBLE_DEVICES`` set per rank) binds each task to its own GPU, which it sees
    as device 0, whatever its local rank."""
    return torch.device("cuda", 0 if torch.cuda.device_count() == 1 else local_rank)


def device_barrier(device: torch.device) -> None:
    """A barrier over the default group (NCCL: on this rank's device, as Lightning's DDP does)."""
    if dist.get_backend() == "nccl" and device.type == "cuda":
        dist.barrier(device_ids=[device.index if device.index is not None else torch.cuda.current_device()])
    else:
        dist.barrier()


def rank_zero_print(message: str) -> None:
    """The engine's default ``info``: printed by rank 0 only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)
