"""float8 training's plumbing, on CPU: what the config checks and the worker refuse, which modules
the conversion swaps, and that a converted model under FSDP2 initialises as the plain one and
precomputes its float8 scales after a step. No float8 matmul runs here: it needs a GPU of compute
capability 8.9 or newer (benchmarks/gpu_check.py measures it there)."""

from __future__ import annotations

import sys
from unittest import mock

import pytest
import torch
from torch import nn

from raylm.config import ConfigError, load_config
from raylm.model.transformer import Transformer
from raylm.parallel import float8
from raylm.parallel.layout import resolve_layout
from raylm.parallel.world import World
from raylm.train.checkpoint import format as checkpoint
from raylm.train.optim import build_optimizer
from raylm.train.step import build_model
from tests.support.cli import assert_clean_refusal, run_main
from tests.support.distributed import run_distributed

pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

# GQA with 8-wide key/value projections: those two linears per block cannot take a float8 matmul.
MODEL = ["model.d_model=48", "model.n_layers=2", "model.n_heads=6", "model.n_kv_heads=1", "model.vocab_size=64",
         "model.max_seq_len=32"]
FLOAT8 = [*MODEL, "train.precision=float8", "parallel.use_gpu=true", "parallel.num_workers=1"]
CONVERTED = {f"layers.{i}.{name}" for i in range(2) for name in ("attention.wq", "attention.wo", "feed_forward.w1",
                                                                  "feed_forward.w2", "feed_forward.w3")}


@pytest.mark.parametrize("overrides, says", [
    (["parallel.use_gpu=false"], "this run is on CPU"),
    (["parallel.num_workers=2", "parallel.tp=2"], "parallel.tp=2: float8 under tensor parallelism is not wired"),
    (["parallel.param_dtype=fp16"], "parallel.param_dtype=fp16"),
])
def test_the_config_refuses_what_no_worker_could_run(overrides: list[str], says: str) -> None:
    outcome = run_main("train", *FLOAT8, *overrides, "--print-config")
    assert_clean_refusal(outcome, "train.precision=float8")
    assert says in outcome.stderr


def test_a_gpu_without_float8_matmuls_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match=r"this worker's NVIDIA A100-SXM4-80GB has 8\.0: use train.precision=bf16"):
        float8.check_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100
    float8.check_device(torch.device("cuda", 0))
    with pytest.raises(ConfigError, match="this worker trains on cpu"):
        float8.check_device(torch.device("cpu"))


def test_the_worker_refuses_float8_on_a_cpu_when_it_builds_the_model() -> None:
    cfg = load_config(None, FLOAT8)  # the driver's checks pass: the config asks for a GPU
    with pytest.raises(ConfigError, match="train.precision=float8: float8 matmuls need an NVIDIA GPU"):
        build_model(lambda: Transformer(cfg.model), cfg, World.current(), resolve_layout(cfg.parallel, cfg.model, 1, 32))


def test_a_worker_without_torchao_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # an import of it now fails
    with pytest.raises(ConfigError, match=r"torchao is not installed on this worker: pip install 'raylm\[float8\]'"):
        float8.convert(nn.Module(), "tensorwise", all_gather=False)


@pytest.mark.parametrize("recipe, all_gather", [("tensorwise", False), ("tensorwise", True), ("rowwise", False)])
def test_only_the_blocks_linears_of_float8_shapes_are_converted(recipe: str, all_gather: bool) -> None:
    import torch._inductor.config

    cfg = load_config(None, MODEL).model
    with torch.device("meta"):
        model = Transformer(cfg)
    names = [name for name, _ in model.named_parameters()]
    with torch._inductor.config.patch(emulate_precision_casts=False):  # the rest of the session's, after
        float8.convert(model, recipe, all_gather)
        emulated = torch._inductor.config.emulate_precision_casts
    converted = {name for name, module in model.named_modules() if isinstance(module, Float8Linear)}
    assert converted == CONVERTED
    assert type(model.output) is nn.Linear and type(model.tok_embeddings) is nn.Embedding  # bf16 under autocast
    assert [name for name, _ in model.named_parameters()] == names  # checkpoints load across precisions
    wrapped = {name for name, p in model.named_parameters() if isinstance(p.data, WeightWithDynamicFloat8CastTensor)}
    assert wrapped == ({f"{name}.weight" for name in CONVERTED} if all_gather else set())
    assert {model.get_submodule(name).config.cast_config_weight.scaling_granularity.value for name in CONVERTED} == {
        "tensorwise" if recipe == "tensorwise" else "axiswise"}
    assert emulated == (recipe == "rowwise")  # torchtitan's workaround for rowwise under compile


def test_float8_all_gather_is_tensorwise_under_fsdp2() -> None:
    def cfg_dims(*extra: str):
        cfg = load_config(None, [*FLOAT8, *extra])
        return cfg, resolve_layout(cfg.parallel, cfg.model, cfg.parallel.num_workers, 32)

    assert float8.all_gathers_float8(*cfg_dims("parallel.num_workers=2", "parallel.sharding=full"))
    assert not float8.all_gathers_float8(*cfg_dims("parallel.num_workers=2", "parallel.sharding=full",
                                                   "train.float8_recipe=rowwise"))
    assert not float8.all_gathers_float8(*cfg_dims("parallel.num_workers=2", "parallel.sharding=none"))
    assert not float8.all_gathers_float8(*cfg_dims("parallel.sharding=full"))  # one rank: no FSDP2
    assert float8.all_gathers_float8(*cfg_dims("parallel.sharding=full", "parallel.one_rank_fsdp=true"))


def _build(*extra: str):
    """The model on this rank, as a worker with an SM 8.9+ GPU builds it, on this CPU (no forward)."""
    cfg = load_config(None, [*FLOAT8, *extra])
    world = World.current()
    with mock.patch.object(float8, "check_device"):
        model = build_model(lambda: Transformer(cfg.model), cfg, world,
                            resolve_layout(cfg.parallel, cfg.model, world.world_size, 32))
    return cfg, model


def _fsdp2_float8(directory: str) -> dict:
    cfg, model = _build("parallel.num_workers=2", "parallel.sharding=full")
    (part,) = model.parts
    converted = [part.get_submodule(name) for name in sorted(CONVERTED)]
    before = [m.weight._local_tensor._precomputed_scale for m in converted]
    float8.after_optimizer_step(model.parts)
    weights = {name: p.full_tensor().tolist() for name, p in part.named_parameters()}
    optimizer = build_optimizer(model.parts, cfg.optim)
    world = World.current()
    checkpoint.save(directory, model, optimizer, world, {"step": 1, "tokenizer_sha256": "t"}, files={})
    torch.distributed.barrier()
    with torch.no_grad():
        for p in part.parameters():
            p.zero_()
    checkpoint.load(directory, model, optimizer, world, "t")
    return {"layout": model.layout, "weights": weights, "before": [scale is None for scale in before],
            "scales": [float(m.weight._local_tensor._precomputed_scale) for m in converted],
            "wrapped": all(isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor) for m in converted),
            "restored": all(p.full_tensor().tolist() == weights[name] for name, p in part.named_parameters())}


@pytest.mark.slow
def test_float8_under_fsdp2_initialises_saves_and_precomputes_its_scales(tmp_path) -> None:
    """FSDP2 all-gathering float8 weights: the seed's initial weights, float8 scales precomputed
    after a step, and a checkpoint of plain tensors (readable where torchao is not imported) that
    restores the float8 model and loads into a plain one."""
    cfg = load_config(None, MODEL)
    plain = build_model(lambda: Transformer(cfg.model), cfg, World.current(), resolve_layout(cfg.parallel, cfg.model, 1, 32))
    for got in run_distributed(_fsdp2_float8, 2, str(tmp_path)):
        assert got["layout"]["float8"] == "tensorwise" and got["layout"]["float8_all_gather"] is True
        assert got["layout"]["mixed_precision"] == "autocast bf16"  # fp32 parameters under FSDP2
        assert got["wrapped"] and all(got["before"]) and all(scale > 0 for scale in got["scales"])
        assert got["restored"]
        for name, p in plain.model.named_parameters():  # the seed's weights, whatever the precision
            assert torch.equal(torch.tensor(got["weights"][name]), p.detach()), name
    assert not any(b"WeightWithDynamicFloat8CastTensor" in shard.read_bytes() for shard in tmp_path.glob("*.distcp"))
    exported = Transformer(cfg.model)
    checkpoint.load_model_weights(str(tmp_path), exported, check=False)
    for name, p in plain.model.named_parameters():
        assert torch.equal(exported.get_parameter(name), p), name


def test_after_optimizer_step_does_nothing_without_float8_all_gather() -> None:
    _, model = _build("parallel.sharding=full")  # one rank: no FSDP2, no float8 all-gather
    assert model.layout["float8_all_gather"] is False
    plain_cfg = load_config(None, MODEL)
    plain = build_model(lambda: Transformer(plain_cfg.model), plain_cfg, World.current(),
                        resolve_layout(plain_cfg.parallel, plain_cfg.model, 1, 32))
    with mock.patch.object(float8, "_torchao_float8") as torchao:
        float8.after_optimizer_step(model.parts)
        float8.after_optimizer_step(plain.parts)
    torchao.assert_not_called()
