"""The step over one rank's batch, whatever the parallel layout: micro-batches with gradient
accumulation, the loss, the global gradient norm and clipping.

`ParallelModel` runs a single part (plain, FSDP2, replicate, TP); `PipelineModel` runs this
rank's pipeline stages through a torch.distributed.pipelining schedule. Both are built by
`build_model`, which applies the layout from outside (`raylm.parallel.parallelize`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from raylm.config import Config, ConfigError
from raylm.model.transformer import document_ids
from raylm.parallel.fsdp import DTYPES, set_micro_batch_sync
from raylm.parallel.layout import MixedPrecision, ParallelDims, num_stages
from raylm.parallel.mesh import ParallelMesh
from raylm.parallel.parallelize import describe_layout, parallelize
from raylm.parallel.world import World
from raylm.train.optim import unique_parameters

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage


IGNORED = -100
"""F.cross_entropy's ignore_index: the target of a row the guard's data check leaves out."""


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def cross_entropy_over_all(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the kept targets, divided by all of them: a micro-batch of left-out
    rows alone adds nothing (a mean over none would be NaN); the caller divides by the share kept."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=IGNORED,
                           reduction="sum") / targets.numel()


def training_loss(z_loss: float, masked: bool = False) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Cross entropy, plus PaLM's z-loss `z_loss * log(Z)^2` (Z the softmax normaliser, averaged
    over tokens) when it is set: it keeps the logits from drifting, an fp16/bf16 stability aid.
    `masked`: targets may be IGNORED (`cross_entropy_over_all`)."""
    ce = cross_entropy_over_all if masked else cross_entropy
    if not z_loss:
        return ce

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        log_z = torch.logsumexp(logits.flatten(0, 1).float(), dim=-1)  # (B*T,)
        return ce(logits, targets) + z_loss * log_z.pow(2).mean()

    return loss


def needs_loss_scaling(cfg: Config) -> bool:
    """fp16 anywhere in the forward or backward: small gradients would flush to zero unscaled."""
    return cfg.train.precision == "fp16" or cfg.parallel.param_dtype == "fp16"


class LossScaler:
    """Dynamic loss scaling (as torch.amp.GradScaler), on the gradient norm the step computes
    anyway: that norm is global (every shard, TP slice and stage), so every rank sees the same
    overflow and no extra collective or host sync is needed. An overflow halves the scale and
    skips the step; `growth_interval` clean steps double it."""

    def __init__(self, initial: float, growth_interval: int, growth: float = 2.0, backoff: float = 0.5):
        self.scale, self.growth_interval, self.growth, self.backoff = initial, growth_interval, growth, backoff
        self.clean_steps = 0

    def unscale(self, parts: list[nn.Module]) -> None:
        """Gradients back to the loss's own scale, before the norm and clipping."""
        grads = [_local_tensor(p.grad) for p in unique_parameters(parts) if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= self.backoff
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth
            self.clean_steps = 0


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _whole(x: torch.Tensor) -> torch.Tensor:
    """A loss under loss-parallel is a replicated DTensor; the bookkeeping wants a plain tensor."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def merged_view(parts: list[nn.Module]) -> nn.Module:
    """One module whose parameter names are the plain model's, over all of this rank's parts.

    Pipeline chunks are separate modules; checkpoints (`get_state_dict`) and optimizers need one
    module naming every parameter they hold. The view shares the parts' submodules (no copies).
    """
    if len(parts) == 1:
        return parts[0]
    view = nn.Module()
    for part in parts:
        for name, child in part.named_children():
            if isinstance(child, nn.ModuleDict):
                if not hasattr(view, name):
                    setattr(view, name, nn.ModuleDict())
                getattr(view, name).update(child)
            else:
                setattr(view, name, child)
    return view


class ParallelModel:
    """A rank's share of the model (one part, or several pipeline chunks) and how to run it.

    With model.attention=document, `eot_id` (the token that ends each document of the packed
    rows) gives every forward its rows' document ids: the model needs no tokenizer."""

    def __init__(self, parts: list[nn.Module], cfg: Config, world: World, mesh: ParallelMesh,
                 eot_id: Optional[int] = None):
        self.parts, self.cfg, self.world, self.mesh = parts, cfg, world, mesh
        self.document_end = eot_id if cfg.model.attention == "document" else None
        # Every parameter this rank holds, under the plain model's names (with pp > 1 a view of
        # the chunks for checkpoints and optimizers, not a callable model).
        self.model = merged_view(parts)
        self.layout: dict = describe_layout(cfg, mesh)
        self.autocast_dtype = MixedPrecision.of(cfg.train.precision, cfg.parallel, mesh.dims).autocast
        self.loss_fns = {masked: training_loss(cfg.train.z_loss, masked) for masked in (False, True)}
        if cfg.train.compile and not cfg.parallel.loss_parallel:
            # As torchtitan's compile of "loss": the logits' fp32 upcast, log-softmax and NLL fuse
            # into one pass over the (tokens x vocab) logits instead of several (loss-parallel's
            # DTensor logits stay eager). Compiled at its first call: the masked one only if used.
            self.loss_fns = {masked: torch.compile(fn) for masked, fn in self.loss_fns.items()}
        self.masked = False  # the step in flight leaves rows out of its loss (`forward_backward`'s `ignore`)
        self.loss_scale = 1.0  # the LossScaler's current scale under fp16; backward sees loss × this

    # Data-parallel coordinates: which share of each global batch this rank consumes. TP and PP
    # peers share them, so they see the same samples.
    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's autocast: train.precision's, or on one rank without FSDP2 parallel.param_dtype's
        (`MixedPrecision`)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.world.device.type, dtype=DTYPES[self.autocast_dtype])

    def _loss_context(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.cfg.parallel.loss_parallel else contextlib.nullcontext()

    def _documents(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's keyword arguments for `inputs` (B, T): their document ids, or none (causal)."""
        return {} if self.document_end is None else {"document_ids": document_ids(inputs, self.document_end)}

    @property
    def loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return self.loss_fns[self.masked]

    def forward_backward(self, tokens: torch.Tensor, micro_batch_size: int,
                         also: Optional[torch.Tensor] = None, ignore: Optional[torch.Tensor] = None
                         ) -> torch.Tensor:
        """Forward and backward over this rank's share of the global batch, in micro-batches.

        `tokens` is (local_batch, T+1). Gradients accumulate so that they equal those of the
        mean loss over the whole global batch; returns that mean loss (a detached scalar,
        averaged across data-parallel ranks). `also`: a vector of this rank's (the guard's data
        check's rows), averaged across those ranks in the loss's own collective: then the loss and
        it are returned as one vector, the loss first. `ignore`: (local_batch,) bool, rows left out
        of the loss (their targets IGNORED): the loss is then the kept targets' over all of them.
        """
        (model,) = self.parts
        micro = tokens.split(micro_batch_size)
        targets = _masked_targets(tokens, ignore).split(micro_batch_size)
        self.masked = ignore is not None
        total = torch.zeros((), device=self.world.device)
        for i, mb in enumerate(micro):
            set_micro_batch_sync(model, self.cfg.parallel.sharding, last=i == len(micro) - 1)
            with self._loss_context():
                with self.autocast():
                    logits = model(mb[:, :-1], **self._documents(mb[:, :-1]))  # (B, T, vocab)
                loss = self.loss_fn(logits, targets[i]) / len(micro)
                (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()
            total += _whole(loss.detach())
        return self.mean_across_dp(_with(total, also))

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
        (model,) = self.parts
        micro = tokens.split(micro_batch_size)
        total = torch.zeros((), device=self.world.device)
        for mb in micro:
            with self._loss_context(), self.autocast():
                logits = model(mb[:, :-1], **self._documents(mb[:, :-1]))
                total += _whole(cross_entropy(logits, mb[:, 1:])) / len(micro)
        self.reshard()
        return self.mean_across_dp(total)

    def reshard(self) -> None:
        """Drop the gathered parameters FSDP2 keeps after a forward without backward.

        Layouts that keep parameters gathered between passes (replicate, `optimizer`,
        `gradients`, the head) free them in backward; after an evaluation-only forward they stay
        gathered, and a later optimizer step (or restore) writes the shards underneath them:
        the next forward would compute with the old weights.
        """
        for part in self.parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def mean_across_dp(self, value: torch.Tensor) -> torch.Tensor:
        if self.mesh.dp is not None:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.mesh.dp.get_group())
            value /= self.dp_size
        return value

    def scale_gradients(self, factor: torch.Tensor) -> None:
        """Every gradient this rank holds times `factor` (a scalar on the device: no host sync)."""
        grads = [_local_tensor(p.grad) for p in unique_parameters(self.parts) if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm before clipping (over every shard, TP slice and stage);
        clips when max_norm > 0."""
        grads = [param.grad for param in unique_parameters(self.parts) if param.grad is not None]
        # Gradients of one kind (same mesh and placements) reduce together; plain tensors are
        # whole on this rank (or identical on its TP peers) and count as they are.
        groups: dict[object, list[torch.Tensor]] = {}
        for g in grads:
            groups.setdefault((g.device_mesh, g.placements) if isinstance(g, DTensor) else None, []).append(g)
        squares = torch.zeros((), device=self.world.device, dtype=torch.float32)
        for group in groups.values():
            squares += _whole(torch.nn.utils.get_total_norm(group, foreach=True)).float() ** 2
        if self.mesh.pp is not None:  # each stage holds different parameters: sum over stages
            dist.all_reduce(squares, group=self.mesh.pp.get_group())
        norm = squares.sqrt()
        if max_norm > 0:
            # On the device (no host sync), in float64 as a Python float would be: gradients
            # scaled by exactly the coefficient the host would compute; 1 leaves them as they are.
            # On the shards themselves: a uniform scale needs no DTensor dispatch, which could
            # redistribute pending (partial) gradients. Offloaded gradients live on the host.
            coef = (max_norm / (norm.double() + 1e-6)).clamp(max=1.0)
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for g in grads:
                by_device.setdefault(_local_tensor(g).device, []).append(_local_tensor(g))
            for device, tensors in by_device.items():
                torch._foreach_mul_(tensors, coef.to(device))
        return norm

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)


class PipelineModel(ParallelModel):
    """Pipeline stages on this rank, driven by a torch.distributed.pipelining schedule."""

    def __init__(self, stages: list[PipelineStage], cfg: Config, world: World, mesh: ParallelMesh,
                 eot_id: Optional[int] = None):
        super().__init__([s.submod for s in stages], cfg, world, mesh, eot_id)
        self.stages = stages
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self._schedules: dict[tuple[int, bool], object] = {}  # by (micro-batches, backward)
        self._last_run: object = None  # the schedule that last set the stages up

    def _schedule(self, local_batch: int, micro_batch_size: int, backward: bool):
        """The training (or forward-only) schedule for this many micro-batches, built on first use."""
        n = self.cfg.parallel.pp_microbatches or local_batch // micro_batch_size
        if local_batch % n:
            raise ValueError(f"the local batch of {local_batch} sequences does not split into {n} pipeline "
                             "micro-batches (parallel.pp_microbatches or train.micro_batch_size)")
        if (n, backward) not in self._schedules:
            from raylm.parallel import pipeline  # with torch's pipelining: see parallelize()

            schedule = pipeline.build_schedule(self.stages, self.cfg.parallel, n,
                                               self._scaled_loss if backward else cross_entropy,
                                               forward_only=not backward)
            self._schedules[n, backward] = schedule
            if backward:
                self.layout.update(pp_microbatches=n,
                                   pp_bubble=pipeline.bubble_fraction(schedule, self.mesh.dims.pp, n))
                if self.world.rank == 0:
                    print(f"[raylm.parallel] pipeline schedule {self.cfg.parallel.pp_schedule}: "
                          f"{num_stages(self.cfg.parallel)} stages, {n} micro-batches, "
                          f"bubble {self.layout['pp_bubble']:.1%} of compute time", flush=True)
        return self._schedules[n, backward]

    def _scaled_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule runs backward on what its loss function returns: scale it there (read
        at each call, as the scale changes), and divide the reported losses back."""
        return self.loss_fn(logits, targets) * self.loss_scale

    def _run(self, tokens: torch.Tensor, micro_batch_size: int, backward: bool,
             also: Optional[torch.Tensor] = None, ignore: Optional[torch.Tensor] = None) -> torch.Tensor:
        schedule = self._schedule(len(tokens), micro_batch_size, backward)
        if self._last_run not in (None, schedule):
            from raylm.parallel import pipeline

            pipeline.set_up_again(schedule)
        self._last_run = schedule
        inputs = (tokens[:, :-1],) if self.has_first else ()  # later stages receive activations
        losses: list[torch.Tensor] = []
        run = schedule.step if backward else schedule.eval
        with self._loss_context(), self.autocast():
            # Keyword arguments reach every stage, split into the same micro-batches as the rows:
            # each stage masks by documents of tokens it never sees (every rank has the rows).
            self.masked = ignore is not None  # read by the last stage's loss function (`_scaled_loss`)
            run(*inputs, target=_masked_targets(tokens, ignore), losses=losses, return_outputs=False,
                **self._documents(tokens[:, :-1]))
        # The last stage's rank knows the loss; a sum over the pipeline group hands it to all.
        loss = torch.stack([_whole(x.detach()) for x in losses]).mean() if self.has_last else \
            torch.zeros((), device=self.world.device)
        if backward and self.loss_scale != 1.0:
            loss = loss / self.loss_scale
        dist.all_reduce(loss, group=self.mesh.pp.get_group())
        return self.mean_across_dp(_with(loss, also))  # every stage holds the rows: `also` is whole on each

    def forward_backward(self, tokens: torch.Tensor, micro_batch_size: int,
                         also: Optional[torch.Tensor] = None, ignore: Optional[torch.Tensor] = None
                         ) -> torch.Tensor:
        return self._run(tokens, micro_batch_size, backward=True, also=also, ignore=ignore)

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
        # A schedule's first use infers its shapes with a real pass and then clears the
        # gradients of FSDP-wrapped stages: keep those of a step the evaluation falls inside.
        grads = [(p, p.grad) for p in unique_parameters(self.parts)]
        loss = self._run(tokens, micro_batch_size, backward=False)
        for p, grad in grads:
            p.grad = grad
        self.reshard()
        return loss


def _with(loss: torch.Tensor, also: Optional[torch.Tensor]) -> torch.Tensor:
    return loss if also is None else torch.cat([loss.reshape(1), also.to(loss.dtype).reshape(-1)])


def _masked_targets(tokens: torch.Tensor, ignore: Optional[torch.Tensor]) -> torch.Tensor:
    """The targets of `tokens` (rows, T+1), those of the `ignore` rows IGNORED."""
    targets = tokens[:, 1:]
    return targets if ignore is None else targets.masked_fill(ignore[:, None], IGNORED)


def build_model(model_factory: Callable[[], nn.Module], cfg: Config, world: World,
                dims: ParallelDims, eot_id: Optional[int] = None) -> ParallelModel:
    """The model with the run's layout (`dims`, resolved for this world) applied, ready for steps;
    `eot_id`, the data's end-of-text token, is needed with model.attention=document."""
    if cfg.model.attention == "document" and eot_id is None:
        raise ConfigError("model.attention=document needs the end-of-text token id of the data (eot_id) "
                          "to find the documents of a packed row")
    built = parallelize(model_factory, cfg, world, dims)
    if built.stages:
        model: ParallelModel = PipelineModel(built.stages, cfg, world, built.mesh, eot_id)
        model.layout["pp_layers"] = built.pp_layers
    else:
        model = ParallelModel(built.parts, cfg, world, built.mesh, eot_id)
    if world.rank == 0:  # under replica groups a group's world is its own: each has this layout
        whose = " of each replica group" if cfg.parallel.fault_tolerance == "replica" else ""
        print(f"[raylm.parallel] layout{whose} {model.layout}", flush=True)
    return model
