"""AdamW parameter groups and the learning-rate schedules."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from raylm.config import ModelConfig, OptimConfig, ScheduleConfig
from raylm.model.transformer import Transformer
from raylm.train.optim import apply_lr, build_optimizer, lr_at

torch.set_num_threads(1)


def model(**overrides) -> Transformer:
    cfg = ModelConfig(**{"d_model": 16, "n_layers": 2, "n_heads": 2, "vocab_size": 11, "max_seq_len": 8,
                         "norm": "layernorm", "bias": True, "tie_embeddings": True,
                         "pos_embedding": "learned", **overrides})
    return Transformer(cfg)


def group_ids(optimizer: torch.optim.Optimizer) -> list[set[int]]:
    return [{id(p) for p in g["params"]} for g in optimizer.param_groups]


def test_decay_on_matrices_only_and_tied_weight_once():
    m = model()
    opt = build_optimizer(m, OptimConfig(weight_decay=0.1, beta1=0.8, beta2=0.9, eps=1e-6, lr=1e-3))
    decay, no_decay = group_ids(opt)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    named = dict(m.named_parameters())
    assert id(m.tok_embeddings.weight) in decay and id(m.pos_embeddings.weight) in decay
    assert id(named["layers.0.attention.wq.weight"]) in decay
    for name in ["layers.0.attention.wq.bias", "layers.0.attention_norm.weight",
                 "layers.0.attention_norm.bias", "norm.weight", "layers.1.feed_forward.w2.bias"]:
        assert id(named[name]) in no_decay, name
    assert len(decay) + len(no_decay) == len(named) == len(list(m.parameters()))
    all_params = [p for g in opt.param_groups for p in g["params"]]
    assert len(all_params) == len({id(p) for p in all_params})
    group = opt.param_groups[0]
    assert group["betas"] == (0.8, 0.9) and group["eps"] == 1e-6 and group["lr"] == 1e-3
    assert group["fused"] and not group["foreach"]  # the fastest update on CPU too


def test_module_list_is_deduplicated_and_frozen_params_skipped():
    m = model()
    m.norm.weight.requires_grad_(False)
    parts = [m.tok_embeddings, m.pos_embeddings, m.output, m.layers, m.norm]  # tied weight in two
    opt = build_optimizer(parts, OptimConfig())
    ids = set.union(*group_ids(opt))
    assert id(m.norm.weight) not in ids
    assert len(ids) == len([p for p in m.parameters() if p.requires_grad])


def test_optimizer_steps_and_apply_lr_sets_every_group():
    m = model()
    opt = build_optimizer(m, OptimConfig())
    apply_lr(opt, 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.5]
    before = m.layers["0"].attention.wq.weight.detach().clone()
    m(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    assert not torch.equal(before, m.layers["0"].attention.wq.weight)


def test_groups_dtensor_parameters_by_global_ndim(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        linear = nn.Linear(4, 3)
        for name, p in list(linear.named_parameters()):
            setattr(linear, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
        opt = build_optimizer(linear, OptimConfig())
        decay, no_decay = group_ids(opt)
        assert decay == {id(linear.weight)} and no_decay == {id(linear.bias)}
        linear(torch.distributed.tensor.DTensor.from_local(torch.ones(2, 4), mesh)).sum().backward()
        opt.step()
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- schedules

MAX = 1e-3


def sched(name: str, **kw) -> ScheduleConfig:
    return ScheduleConfig(name=name, **{"warmup_steps": 10, "min_lr": 1e-4, **kw})


def test_warmup_is_nanogpts_for_every_schedule():
    for name in ["cosine", "linear", "inverse_sqrt", "wsd", "constant"]:
        s = sched(name)
        assert lr_at(0, s, MAX, 100) == pytest.approx(MAX / 11)
        assert lr_at(9, s, MAX, 100) == pytest.approx(MAX * 10 / 11)
        assert lr_at(10, s, MAX, 100) == pytest.approx(MAX), name  # first step at the peak


def test_cosine():
    s = sched("cosine")
    assert lr_at(55, s, MAX, 100) == pytest.approx(1e-4 + 0.5 * (MAX - 1e-4))  # midpoint of decay
    assert lr_at(32, s, MAX, 100) == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi * 22 / 90)) * 9e-4)
    assert lr_at(99, s, MAX, 100) == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi * 89 / 90)) * 9e-4)
    assert lr_at(100, s, MAX, 100) == pytest.approx(1e-4)
    assert lr_at(150, s, MAX, 100) == pytest.approx(1e-4)


def test_cosine_without_warmup_starts_at_the_peak():
    assert lr_at(0, sched("cosine", warmup_steps=0), MAX, 100) == pytest.approx(MAX)


def test_linear():
    s = sched("linear", final_lr_fraction=0.1)
    assert lr_at(55, s, MAX, 100) == pytest.approx(0.55 * MAX)
    assert lr_at(99, s, MAX, 100) == pytest.approx(MAX - 89 / 90 * 0.9 * MAX)
    assert lr_at(100, s, MAX, 100) == pytest.approx(0.1 * MAX)


def test_inverse_sqrt():
    s = sched("inverse_sqrt")
    assert lr_at(40, s, MAX, 100) == pytest.approx(MAX / 2)
    assert lr_at(90, s, MAX, 100) == pytest.approx(MAX / 3)
    no_warmup = sched("inverse_sqrt", warmup_steps=0)
    assert [lr_at(k, no_warmup, MAX, 100) for k in (0, 1, 4)] == pytest.approx([MAX, MAX, MAX / 2])


def test_wsd():
    s = sched("wsd", decay_fraction=0.2)
    assert lr_at(50, s, MAX, 100) == pytest.approx(MAX)
    assert lr_at(80, s, MAX, 100) == pytest.approx(MAX)  # decay starts at step 80
    assert lr_at(90, s, MAX, 100) == pytest.approx(0.5 * (MAX + 1e-4))
    assert lr_at(99, s, MAX, 100) == pytest.approx(MAX - 19 / 20 * 9e-4)
    assert lr_at(100, s, MAX, 100) == pytest.approx(1e-4)


def test_constant():
    s = sched("constant")
    assert [lr_at(k, s, MAX, 100) for k in (10, 55, 99)] == [MAX] * 3


def test_schedule_errors_name_the_field():
    with pytest.raises(ValueError, match="schedule.name"):
        lr_at(0, ScheduleConfig(name="step"), MAX, 100)
    with pytest.raises(ValueError, match="schedule.min_lr"):
        lr_at(0, sched("cosine", min_lr=1e-2), MAX, 100)
    with pytest.raises(ValueError, match="step"):
        lr_at(-1, sched("cosine"), MAX, 100)
