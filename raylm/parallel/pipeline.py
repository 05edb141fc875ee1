"""Pipeline stages of a `Transformer`: split the layer list, build stages, pick a schedule,
and compute the schedule's bubble.

A stage is a deep copy of the model with what it does not own deleted (torchtitan's manual
split): layers keep their "0".."n-1" keys, so parameter names are those of the plain model and
checkpoints load into any layout. The embedding is on stage 0, the final norm and head on the
last stage. With pp_virtual_stages = v each rank holds v stages: looped (rank r holds r, r+pp,
...) for interleaved schedules, or a V (r and 2pp-1-r) for ZBV and DualPipeV.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S

from raylm.config import ParallelConfig
from raylm.parallel.layout import V_SCHEDULES, num_stages

PIPELINE_SCHEDULES: dict[str, type] = {
    "gpipe": S.ScheduleGPipe,
    "1f1b": S.Schedule1F1B,
    "interleaved_1f1b": S.ScheduleInterleaved1F1B,
    "looped_bfs": S.ScheduleLoopedBFS,
    "interleaved_zero_bubble": S.ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": S.ScheduleZBVZeroBubble,
    "dualpipev": S.ScheduleDualPipeV,
}


def _numel(*modules: nn.Module | None) -> int:
    return sum(param.numel() for m in modules if m is not None for param in m.parameters())


def balanced_split(costs: list[int], stages: int, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """Layers per stage: contiguous, >= 1 each, minimising the costliest stage, then (among
    splits as good) the spread of the others, so stages without the ends balance too.

    `first_extra` / `last_extra` are added to the first / last stage (embedding / norm + head).
    Exact dynamic programmes over split points, O(stages * layers^2).
    """
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, i: int, j: int) -> int:  # stage s holds layers [i, j)
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0) + (last_extra if s == stages - 1 else 0)

    worst, _ = _best_split(len(costs), stages, cost, lambda c: c, max)
    _, counts = _best_split(len(costs), stages, cost, lambda c: c * c, lambda a, b: a + b, limit=worst)
    return counts


def _best_split(n: int, stages: int, cost: Callable[[int, int, int], int], score: Callable[[int], float],
                combine: Callable[[float, float], float], limit: float = float("inf")) -> tuple[float, list[int]]:
    """The split of n layers into `stages` contiguous groups with the best combined score,
    no stage costing more than `limit`: (score, layers per stage)."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages)]  # best[s][j]: layers [0, j) on stages 0..s
    cut = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        if cost(0, 0, j) <= limit:
            best[0][j] = score(cost(0, 0, j))
    for s in range(1, stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                if best[s - 1][i] < inf and cost(s, i, j) <= limit:
                    value = combine(best[s - 1][i], score(cost(s, i, j)))
                    if value < best[s][j]:
                        best[s][j], cut[s][j] = value, i
    counts, j = [], n
    for s in range(stages - 1, 0, -1):
        counts.append(j - cut[s][j])
        j = cut[s][j]
    counts.append(j)
    return best[stages - 1][n], counts[::-1]


def even_split(n_layers: int, stages: int) -> list[int]:
    """As equal as possible; the extra layers go to the middle stages (the ends hold embedding and head)."""
    counts = [n_layers // stages] * stages
    middle_first = sorted(range(stages), key=lambda s: abs(s - (stages - 1) / 2))
    for s in middle_first[: n_layers % stages]:
        counts[s] += 1
    return counts


def layer_split(model: nn.Module, parallel: ParallelConfig) -> list[list[str]]:
    """The layer keys of each stage, per pp_layer_split, or balanced per pp_balance."""
    keys = list(model.layers.keys())
    stages = num_stages(parallel)
    if parallel.pp_layer_split:
        counts = list(parallel.pp_layer_split)
    elif parallel.pp_balance == "layers":
        counts = even_split(len(keys), stages)
    else:
        counts = balanced_split([_numel(model.layers[k]) for k in keys], stages,
                                first_extra=_numel(model.tok_embeddings, model.pos_embeddings),
                                last_extra=_numel(model.norm, model.output))
    groups, start = [], 0
    for c in counts:
        groups.append(keys[start:start + c])
        start += c
    return groups


def stage_ids(pp_rank: int, parallel: ParallelConfig) -> list[int]:
    """The stages this pipeline rank runs, in order."""
    if parallel.pp_schedule in V_SCHEDULES:
        return [pp_rank, 2 * parallel.pp - 1 - pp_rank]
    return [pp_rank + k * parallel.pp for k in range(parallel.pp_virtual_stages)]


def stage_module(model: nn.Module, layers: list[str], first: bool, last: bool) -> nn.Module:
    """A copy of `model` keeping only `layers` (and the embedding / the head on the ends)."""
    dropped = [block for key, block in model.layers.items() if key not in layers]
    if not first:
        dropped += [model.tok_embeddings, model.pos_embeddings]
    if not last:
        dropped += [model.norm, model.output]
    # A memo entry of None makes deepcopy put None where the original has a dropped module, so
    # only what the stage keeps is copied.
    stage = copy.deepcopy(model, memo={id(m): None for m in dropped if m is not None})
    for key in [k for k, block in stage.layers.items() if block is None]:
        del stage.layers[key]
    return stage


def build_schedule(stages: list[PipelineStage], parallel: ParallelConfig, n_microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   forward_only: bool = False) -> S._PipelineSchedule:
    """The configured schedule over this rank's stages; gradients are averaged over micro-batches.

    `forward_only` gives an instance for `eval()`: torch 2.13's multi-stage schedules run their
    backward actions in eval() too (ZBV and DualPipeV then fail handing a gradient between a
    rank's two stages), so its action lists keep only the forwards and their communication; and
    the single-stage ones still scale the gradients at the end, which would shrink those of a
    training step that an evaluation (the guard's canary) reads the model in the middle of.
    """
    cls = PIPELINE_SCHEDULES[parallel.pp_schedule]
    single = issubclass(cls, S.PipelineScheduleSingle)
    try:
        schedule = cls(stages[0] if single else stages, n_microbatches=n_microbatches, loss_fn=loss_fn,
                       scale_grads=not forward_only)
    except ValueError as e:
        raise ValueError(f"parallel.pp_schedule={parallel.pp_schedule} with {n_microbatches} micro-batches over "
                         f"{num_stages(parallel)} stages (pp={parallel.pp}): {str(e).rstrip('.')}; change "
                         "parallel.pp_microbatches or the batch / micro-batch size") from e
    if forward_only and not single:
        schedule.pipeline_order_with_comms = {
            rank: [f for a in actions for f in _forward_work(a)]
            for rank, actions in schedule.pipeline_order_with_comms.items()}
    return schedule


def set_up_again(schedule: S._PipelineSchedule) -> None:
    """Have `schedule` set its stages up again on its next use.

    The training and the forward-only schedules share the stages; a schedule sets them up (receive
    buffers with or without gradients) once and would not notice that the other one has since set
    them up its own way: training after an evaluation would then send no gradient back to the
    earlier stages. torch's own `eval()` switches the same way, with a fresh set-up per switch.
    """
    for flag in ("_stage_forward_initialized", "_stage_backward_initialized",
                 "_stages_forward_initialized", "_stages_backward_initialized"):
        if hasattr(schedule, flag):
            setattr(schedule, flag, False)


def _forward_work(action: S._Action) -> list[S._Action]:
    """The forward part of an action: itself, nothing, or a forward overlapped with a backward."""
    if action.computation_type == S.OVERLAP_F_B:
        return [a for a in action.sub_actions if a.computation_type == S.FORWARD]
    keep = action.computation_type in (S.FORWARD, S.SEND_F, S.RECV_F, S.UNSHARD, S.RESHARD)
    return [action] if keep else []


# Relative cost of each computation: a full backward is an input- plus a weight-gradient pass.
_COST = {S.FORWARD: 1, S.BACKWARD_INPUT: 1, S.BACKWARD_WEIGHT: 1, S.FULL_BACKWARD: 2}


def bubble_fraction(schedule: S._PipelineSchedule, pp: int, n_microbatches: int) -> float:
    """Idle share of the pipeline ranks' compute time under `schedule`; communication is free.

    GPipe and 1F1B: (pp - 1) / (m + pp - 1) with m micro-batches. Multi-stage schedules: their
    action lists (`pipeline_order`, the IR they execute) are simulated.
    """
    if isinstance(schedule, S.PipelineScheduleSingle):  # their pipeline_order is only a sketch
        return (pp - 1) / (n_microbatches + pp - 1)
    return simulated_bubble(schedule.pipeline_order, schedule._num_stages)


def simulated_bubble(pipeline_order: dict[int, list], n_stages: int) -> float:
    """Ranks run their actions in order, each as soon as its inputs exist (forward after the
    previous stage's forward, backward after the next stage's), with forward = input-grad =
    weight-grad = 1 and full backward = 2 time units; returns the idle share of rank time."""
    compute = (*_COST, S.OVERLAP_F_B)
    queues = {r: [a for a in actions if a is not None and a.computation_type in compute]
              for r, actions in pipeline_order.items()}
    done: dict[tuple, float] = {}  # (stage, kind, microbatch) -> finish time
    clock = {r: 0.0 for r in queues}
    busy = 0.0

    def deps(a) -> list[tuple]:
        s, kind, mb = a.stage_index, a.computation_type, a.microbatch_index
        if kind == S.FORWARD:
            return [(s - 1, S.FORWARD, mb)] if s > 0 else []
        if kind == S.BACKWARD_WEIGHT:
            return [(s, S.BACKWARD_INPUT, mb)]
        if s == n_stages - 1:
            return [(s, S.FORWARD, mb)]
        return [(s + 1, S.BACKWARD_INPUT, mb), (s, S.FORWARD, mb)]

    def leaves(a) -> list:
        return list(a.sub_actions) if a.sub_actions else [a]

    def key(a) -> tuple:  # a full backward also produces the input gradient the previous stage needs
        kind = S.BACKWARD_INPUT if a.computation_type == S.FULL_BACKWARD else a.computation_type
        return a.stage_index, kind, a.microbatch_index

    while any(queues.values()):
        progressed = False
        for r, queue in queues.items():
            while queue:
                own = {key(leaf) for leaf in leaves(queue[0])}  # an overlapped F+B feeds itself
                needed = [d for leaf in leaves(queue[0]) for d in deps(leaf) if d not in own]
                if any(d not in done for d in needed):
                    break
                action = queue.pop(0)
                start = max([clock[r], *(done[d] for d in needed)])
                for leaf in leaves(action):
                    start += _COST[leaf.computation_type]
                    done[key(leaf)] = start
                    busy += _COST[leaf.computation_type]
                clock[r] = start
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule simulation is stuck: an action waits on one never run")
    return 1.0 - busy / (len(queues) * max(clock.values()))
