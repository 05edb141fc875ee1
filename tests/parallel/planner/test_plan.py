"""The layout planner: the ZeRO table, activation and communication formulas, OPT-175B on 1024
A100s, the CLI entry point, and the estimate against bytes measured on real gloo process groups."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from raylm.ports import free_ports

from raylm.config import ConfigError, ModelConfig, ParallelConfig, config_from_dict
from raylm.config.presets import preset
from raylm.model.sizes import count_params
from raylm.parallel.planner.memory import (PRECISIONS, estimate_communication, estimate_memory, layer_activation_bytes,
                                   model_shape, model_state_bytes, selective_layer_bytes)
from raylm.parallel.layout import resolve_layout
from raylm.parallel.planner.plan import enumerate_layouts, parallel_block_yaml, parse_memory, plan, run_plan
from tests.support.cli import assert_clean_refusal, run_main

GB = 1e9
OPT_175B = ModelConfig(**preset("175b"), vocab_size=50272)
# The ZeRO paper's setting (Rajbhandari et al. 2020, figure 1): mixed precision Adam, Nd = 64.
ZERO_ND = 64


def _total(states: dict[str, float]) -> float:
    return sum(states.values())


def layout(num_workers: int = 1, **fields) -> ParallelConfig:
    """A layout on `num_workers` GPUs with sequence and loss parallelism on when tp > 1, as the
    planner sets them."""
    tp = fields.get("tp", 1) > 1
    return ParallelConfig(num_workers=num_workers, **{"sequence_parallel": tp, "loss_parallel": tp, **fields})


def test_pure_bf16_10b_needs_80gb_per_replica():
    states = model_state_bytes(10e9, "bf16", "none", dp_shard=1)
    assert states == {"params": 20 * GB, "grads": 20 * GB, "optimizer": 40 * GB, "master": 0.0}  # m 20 + v 20
    assert _total(states) == 80 * GB


@pytest.mark.parametrize("psi, expected_gb", [
    (10e9, {"none": 160.0, "optimizer": 41.875, "gradients": 22.1875, "full": 2.5}),
    # Figure 1 of the ZeRO paper prints these rounded: 120, 31.4, 16.6, 1.9 GB.
    (7.5e9, {"none": 120.0, "optimizer": 31.40625, "gradients": 16.640625, "full": 1.875}),
])
def test_zero_stages_reproduce_the_zero_paper(psi, expected_gb):
    for sharding, gb in expected_gb.items():
        assert _total(model_state_bytes(psi, "mixed", sharding, ZERO_ND)) == pytest.approx(gb * GB, rel=1e-12)
    full = model_state_bytes(psi, "mixed", "none", 1)
    assert full["master"] + full["optimizer"] == 12 * psi  # K = 12: fp32 master + m + v


def test_bytes_per_parameter_of_each_precision():
    per_param = {name: _total(model_state_bytes(1, name, "none", 1)) for name in PRECISIONS}
    assert per_param == {"bf16": 8, "mixed": 16, "fp16": 16, "amp": 16, "fp32": 16}


def test_estimate_memory_applies_the_table_to_a_10b_model():
    cfg = ModelConfig(**{**preset("13b"), "d_model": 5120, "n_layers": 32}, vocab_size=50272)
    psi = count_params(cfg)
    assert 9.5e9 < psi < 10.5e9
    ddp = estimate_memory(cfg, layout(64, dp_replicate=64), "bf16", 2048)
    assert ddp.model_states == 8 * psi
    zero3 = estimate_memory(cfg, layout(64, dp_shard=64, sharding="full"), "mixed", 2048)
    assert zero3.model_states == pytest.approx(16 * psi / 64)
    hsdp = estimate_memory(cfg, layout(64, dp_replicate=8, dp_shard=8, sharding="full"), "mixed", 2048)
    assert hsdp.model_states == pytest.approx(16 * psi / 8)  # only the shard dimension divides
    tp = estimate_memory(cfg, layout(8, tp=8), "mixed", 2048)
    assert tp.model_states == pytest.approx(16 * psi / 8)


def test_pipeline_stage_holds_its_blocks_and_the_embeddings():
    shape = model_shape(OPT_175B)
    # 1F1B: the first stage keeps 8 microbatches in flight, so it is the worst.
    first = estimate_memory(OPT_175B, layout(8, pp=8), "bf16", 2048, n_microbatches=8)
    assert first.stage == 0
    assert first.params == 2 * (12 * shape.block_params + shape.first_params)  # token + position embeddings
    # With one microbatch the last stage's logits tip it; a tied head is a second copy there.
    last = estimate_memory(OPT_175B, layout(8, pp=8), "bf16", 2048, n_microbatches=1)
    assert last.stage == 7
    assert last.params == 2 * (12 * shape.block_params + shape.last_params + shape.vocab * shape.d_model)


def test_activations_reproduce_korthikanti_without_flash_attention():
    cfg = ModelConfig(d_model=1024, n_layers=4, n_heads=16, mlp="gelu", dropout=0.1, vocab_size=1000,
                      max_seq_len=2048)
    shape = model_shape(cfg)
    s, b, h, a = 2048, 4, 1024, 16
    paper = s * b * h * (34 + 5 * a * s / h)
    for tp in (1, 8):  # with sequence parallelism everything divides by tp
        got = layer_activation_bytes(shape, s, b, tp, PRECISIONS["mixed"], flash_attention=False)
        assert got == pytest.approx(paper / tp)
    no_sp = layer_activation_bytes(shape, s, b, 8, PRECISIONS["mixed"], flash_attention=False, sequence_parallel=False)
    assert no_sp == pytest.approx(s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    flash = layer_activation_bytes(shape, s, b, 1, PRECISIONS["mixed"], flash_attention=True)
    assert flash == pytest.approx(s * b * h * 34)


def test_full_checkpointing_keeps_layer_inputs_and_one_layer():
    cfg = replace(OPT_175B, n_layers=8)
    est = estimate_memory(cfg, layout(activation_checkpointing="full"), "mixed", 2048, micro_batch_size=2)
    layer = layer_activation_bytes(model_shape(cfg), 2048, 2, 1, PRECISIONS["mixed"])
    logits = 2048 * 2 * 50272 * (2 + 8)
    assert est.activations == pytest.approx(8 * 2 * 2048 * 2 * 12288 + layer + logits)
    assert est.activations_no_checkpointing == pytest.approx(8 * layer + logits)
    every_3 = estimate_memory(cfg, layout(activation_checkpointing="every_k", ac_every=3), "mixed", 2048, 2)
    # raylm checkpoints blocks 0, 3 and 6 of 8
    assert every_3.activations == pytest.approx(3 * 2 * 2048 * 2 * 12288 + 5 * layer + layer + logits)
    in_flight = estimate_memory(cfg, layout(4, pp=4, activation_checkpointing="none"), "mixed", 2048, n_microbatches=16)
    first_stage = 4 * 2 * layer_activation_bytes(model_shape(cfg), 2048, 1, 1, PRECISIONS["mixed"])
    assert in_flight.activations_no_checkpointing >= first_stage  # 4 microbatches x 2 blocks


def test_selective_checkpointing_keeps_the_matmul_outputs():
    # The paper's GeLU 4h block with dropout keeps 22·s·b·h of its 34: the input (2), Q, K, V (6),
    # the attention output (2), wo's and w2's outputs (4) and the MLP's up projection (8); no
    # dropout masks, no scores.
    cfg = ModelConfig(d_model=1024, n_layers=4, n_heads=16, mlp="gelu", dropout=0.1, vocab_size=1000,
                      max_seq_len=2048)
    s, b, h, mixed = 2048, 4, 1024, PRECISIONS["mixed"]
    assert selective_layer_bytes(model_shape(cfg), s, b, 1, mixed) == pytest.approx(22 * s * b * h)
    # TP 8 with SP: wo's and w2's partial sums stay whole; the block input and their
    # reduce-scattered outputs divide by tp like the heads and MLP columns.
    assert selective_layer_bytes(model_shape(cfg), s, b, 8, mixed) == pytest.approx(s * b * h * (4 + 16 / 8 + 6 / 8))
    # SwiGLU's two up projections, GQA's smaller K and V; fp32 doubles every byte.
    llama = replace(cfg, mlp="swiglu", n_kv_heads=4, dropout=0.0)
    f = model_shape(llama).ffn_hidden
    assert selective_layer_bytes(model_shape(llama), s, b, 1, PRECISIONS["fp32"]) == \
        pytest.approx(2 * s * b * h * (10 + 4 * 4 / 16 + 4 * f / h))

    est = estimate_memory(cfg, layout(activation_checkpointing="selective"), "mixed", s, b)
    logits = s * b * 1000 * (2 + 8)
    full_layer = layer_activation_bytes(model_shape(cfg), s, b, 1, mixed)
    assert est.activations == pytest.approx(4 * 22 * s * b * h + full_layer + logits)  # + one block's recompute
    assert est.activations_full_checkpointing < est.activations < est.activations_no_checkpointing

    def compute_s(mode: str) -> dict:
        return {(r.layout.dp_shard, r.layout.tp, r.layout.pp, r.layout.sharding): r.compute_s
                for r in plan(cfg, 8, 8, 80 * GB, s, activation_checkpointing=mode)}

    # Its recompute is norms and elementwise ops: no matmul FLOPs in the step-time proxy.
    none, selective, full = compute_s("none"), compute_s("selective"), compute_s("full")
    assert selective == none and all(full[key] > none[key] for key in none)


def test_communication_volumes():
    cfg, n = OPT_175B, 64
    shape = model_shape(cfg)
    psi = shape.total_params
    ddp = estimate_communication(cfg, layout(n, dp_replicate=n), "mixed", 2048)
    assert ddp.data_parallel == pytest.approx(2 * psi * (n - 1) / n * 2)
    zero3 = estimate_communication(cfg, layout(n, dp_shard=n, sharding="full"), "mixed", 2048)
    assert zero3.data_parallel == pytest.approx(3 * psi * (n - 1) / n * 2)
    assert zero3.inter_node == zero3.data_parallel  # 64 ranks span 8 nodes
    # Over 4 microbatches ZeRO-3 gathers twice and reduce-scatters once per microbatch, ZeRO-2
    # gathers once per step and reduce-scatters per microbatch, ZeRO-1 and DDP sync once per step.
    per_step = {sharding: estimate_communication(cfg, layout(n, dp_shard=n, sharding=sharding), "mixed", 2048,
                                                 n_microbatches=4).data_parallel / (psi * (n - 1) / n * 2)
                for sharding in ("full", "gradients", "optimizer")}
    assert per_step == pytest.approx({"full": 12, "gradients": 5, "optimizer": 2})
    tp = estimate_communication(cfg, layout(8, tp=8), "mixed", 2048, micro_batch_size=1, n_microbatches=2)
    assert tp.tensor_parallel == pytest.approx(2 * 96 * 4 * 2 * 7 / 8 * 2048 * 12288 * 2)
    assert tp.inter_node == 0


def test_enumerated_layouts_follow_the_rule():
    layouts = enumerate_layouts(64, 8, n_heads=32, n_layers=24, n_kv_heads=8)
    assert len({repr(lay) for lay in layouts}) == len(layouts)  # no duplicates (ParallelConfig is unhashable)
    for lay in layouts:
        assert lay.num_workers == 64
        assert 8 % lay.tp == 0 and 32 % lay.tp == 0 and lay.pp <= 24  # node, heads, kv heads (8)
        if lay.sharding == "none":
            assert lay.dp_shard == 1
        else:
            assert lay.dp_shard > 1
            if lay.dp_replicate > 1:  # HSDP: each shard group inside one node
                assert 8 % (lay.tp * lay.dp_shard) == 0
    assert layout(64, use_gpu=True, dp_replicate=8, dp_shard=8, sharding="full") in layouts
    assert layout(64, use_gpu=True, dp_replicate=4, dp_shard=16, sharding="full") not in layouts
    assert not any(lay.tp == 16 for lay in layouts)


def test_opt_175b_needs_model_parallelism_on_1024_a100s():
    rows = plan(OPT_175B, gpus=1024, gpus_per_node=8, gpu_memory_bytes=parse_memory("80GB"), seq_len=2048,
                global_batch_tokens=2**21)
    no_model_parallel = [r for r in rows if r.layout.tp == 1 and r.layout.pp == 1]
    assert no_model_parallel and not any(r.feasible for r in no_model_parallel)
    for row in no_model_parallel:
        assert "GB usable" in row.reason
    # OPT ties its embeddings, which raylm's pipeline stages cannot share.
    assert all("tie_embeddings" in r.reason for r in rows if r.layout.pp > 1)
    (opt_layout,) = [r for r in rows if r.layout == layout(1024, use_gpu=True, dp_shard=128, tp=8, sharding="full",
                                                         param_dtype="bf16", reduce_dtype="bf16")]
    assert opt_layout.feasible, opt_layout.reason
    assert rows[0].feasible
    # That verdict is without activation checkpointing: with it ZeRO-3 over 1024 ranks fits in
    # memory too (the ZeRO-Infinity regime), only slower; selective checkpointing is enough.
    rows = plan(OPT_175B, 1024, 8, 80 * GB, 2048, 2**21, activation_checkpointing="auto")
    (zero3,) = [r for r in rows if (r.layout.dp_shard, r.layout.tp, r.layout.sharding) == (1024, 1, "full")]
    assert zero3.feasible and zero3.layout.activation_checkpointing == "selective"
    (opt_layout,) = [r for r in rows if (r.layout.dp_shard, r.layout.tp, r.layout.sharding) == (128, 8, "full")]
    assert opt_layout.layout.activation_checkpointing == "none"  # auto checkpoints only what needs it


@pytest.mark.parametrize("precision, checkpointing", [("mixed", "none"), ("amp", "auto"), ("fp32", "full")])
def test_parallel_block_yaml_is_a_parallel_config_raylm_accepts(precision, checkpointing):
    rows = plan(OPT_175B, 1024, 8, 80 * GB, 2048, precision=precision, activation_checkpointing=checkpointing)
    lay = rows[0].layout
    block = yaml.safe_load(parallel_block_yaml(rows[0], precision))["parallel"]
    assert set(block) <= set(ParallelConfig.__dataclass_fields__)
    # The block belongs to the model it was planned for (tp=8 would not fit a 4-head default).
    cfg = config_from_dict({"model": {"size": "175b", "vocab_size": 50272}, "parallel": block})
    resolve_layout(cfg.parallel, OPT_175B, 1024)
    assert cfg.parallel.num_workers == 1024
    assert (cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.tp, cfg.parallel.pp) == (
        lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp)
    assert (cfg.parallel.sharding, cfg.parallel.activation_checkpointing) == (lay.sharding, lay.activation_checkpointing)
    assert cfg.parallel.sequence_parallel == (lay.tp > 1)
    assert cfg.parallel.param_dtype == ("bf16" if precision == "mixed" else "fp32")


def test_parse_memory():
    assert parse_memory("80GB") == 80 * 10**9
    assert parse_memory("80 GiB") == 80 * 2**30
    assert parse_memory("1.5tb") == 1.5e12
    assert parse_memory("512MiB") == 512 * 2**20
    for bad in ("80", "eighty GB", "80GX"):
        with pytest.raises(ConfigError, match="memory size"):
            parse_memory(bad)


def test_run_plan_for_a_size_and_a_config_file(tmp_path: Path):
    out = tmp_path / "parallel.yaml"
    text, fits = run_plan("1.3b", gpus=16, gpus_per_node=8, gpu_memory="40GB", precision="mixed", output=str(out))
    assert fits and "Recommended:" in text and "vocab_size is unset" in text
    assert yaml.safe_load(out.read_text())["parallel"]["num_workers"] == 16
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"size": "125m", "vocab_size": 50304}, "train": {"seq_len": 1024}}))
    text, fits = run_plan(str(config), gpus=8, gpus_per_node=8, gpu_memory="80GiB", global_batch_tokens=2**19)
    assert fits and "seq_len 1024" in text and "note" not in text
    with pytest.raises(ConfigError, match="neither a named size"):
        run_plan("no-such-model", 8, 8, "80GB")


# ----------------------------------------------------------------------------- measured on gloo

MEASURED_MODELS = {
    # OPT-like: tied embeddings, learned positions, biases, LayerNorm, ReLU.
    2: dict(preset("125m"), d_model=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=32),
    # LLaMA-like: untied, RoPE, SwiGLU, GQA.
    4: dict(preset("tiny"), d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32),
}


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def _measure_worker(rank: int, world_size: int, port: int, cfg: ModelConfig, out_dir: str) -> None:
    """One fp32 AdamW step under DDP, FSDP2 (ZeRO-3) and, on 4 ranks, HSDP 2 x 2; writes the
    bytes of parameters, gradients and optimizer states this rank holds."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from raylm.model.transformer import Transformer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A rank stuck in a collective fails the test in two minutes instead of hanging the suite.
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    meshes = {"full": ((world_size,), ("dp_shard",))}
    if world_size == 4:
        meshes["hsdp"] = ((2, 2), ("dp_replicate", "dp_shard"))
    results = {}
    try:
        for name in ["none", *meshes]:
            torch.manual_seed(0)
            model = Transformer(cfg)
            if name == "none":
                wrapped = DistributedDataParallel(model)
            else:
                shape, names = meshes[name]
                mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
                for block in model.layers.values():
                    fully_shard(block, mesh=mesh)
                wrapped = fully_shard(model, mesh=mesh)
            optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
            tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(rank))
            logits = wrapped(tokens[:, :-1])  # (B, T, vocab)
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            optimizer.step()
            params = list(wrapped.parameters())
            results[name] = {
                "params": sum(_local_bytes(p) for p in params),
                "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
                "optimizer": sum(_local_bytes(v) for state in optimizer.state.values()
                                 for v in state.values() if torch.is_tensor(v)),
            }
        Path(out_dir, f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_estimate_matches_measured_bytes_on_cpu(world_size: int, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = ModelConfig(**MEASURED_MODELS[world_size])
    # A fork server imports torch once and forks every rank from its single thread: safe, and
    # seconds instead of the tens that spawned ranks take to import torch each on two cores.
    multiprocessing.set_forkserver_preload([__name__])
    torch.multiprocessing.start_processes(_measure_worker, args=(world_size, free_ports(1)[0], cfg, str(tmp_path)),
                                          nprocs=world_size, join=True, start_method="forkserver")
    layouts = {"none": layout(world_size, dp_replicate=world_size),
               "full": layout(world_size, dp_shard=world_size, sharding="full"),
               "hsdp": layout(world_size, dp_replicate=2, dp_shard=2, sharding="full")}
    for rank in range(world_size):
        measured = json.loads((tmp_path / f"{rank}.json").read_text())
        for name, held in measured.items():
            est = estimate_memory(cfg, layouts[name], "fp32", seq_len=16, micro_batch_size=2)
            assert est.master == 0
            for term, got in held.items():
                expected = getattr(est, term)
                # The issue asks for 10%; the shards are exact and only Adam's step counters
                # (4 bytes per tensor) differ, so hold the estimate to 1%.
                assert abs(got - expected) <= 0.01 * expected, (rank, name, term, got, expected)


# ----------------------------------------------------------------------------- measured on a GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_estimate_bounds_cuda_peak_memory():
    """Single-GPU fp32 weights under bf16 autocast (precision amp): the estimated total against
    torch.cuda.max_memory_allocated over forward and backward of a step with Adam state."""
    import torch.nn.functional as F

    from raylm.model.transformer import Transformer

    cfg = ModelConfig(**preset("mini"), vocab_size=32768)
    cfg = replace(cfg, d_model=1024, n_layers=8, n_heads=16, max_seq_len=1024)
    seq_len, batch = 1024, 8
    model = Transformer(cfg).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), device="cuda")

    def forward_backward() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])  # (B, T, vocab)
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()

    forward_backward()
    optimizer.step()  # Adam state now exists
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats()
    forward_backward()
    peak = torch.cuda.max_memory_allocated()
    est = estimate_memory(cfg, layout(), "amp", seq_len, batch).total
    assert 0.7 * peak <= est <= 1.3 * peak, (est / 1e9, peak / 1e9)


def test_the_cli_exits_non_zero_when_no_layout_fits_and_refuses_bad_arguments(tmp_path):
    outcome = run_main("plan", "--model", "175b", "--gpus", "2", "--gpu-memory", "1GB")
    assert outcome.status == 1 and "No layout fits" in outcome.stdout
    assert outcome.stderr.strip() == "raylm: error: no layout fits (see the table above)"
    assert run_main("plan", "--model", "1.3b", "--gpus", "16", "--gpu-memory", "80GB").status == 0
    for argv, name in ((["--seq-len", "0"], "--seq-len"), (["--seq-len", "-5"], "--seq-len"),
                       (["--vocab-size", "0"], "--vocab-size"), (["--gpus", "0"], "--gpus")):
        outcome = run_main("plan", "--model", "tiny", "--gpus", "2", *argv)
        assert outcome.status == 2 and name in outcome.stderr and len(outcome.stderr.splitlines()) == 1
    outcome = run_main("plan", "--model", "tiny", "--gpus", "2", "--output", str(tmp_path))
    assert_clean_refusal(outcome, f"--output {tmp_path} is a directory")
    # An existing file (a user's hand-written block) is replaced only when told.
    block = tmp_path / "parallel.yaml"
    block.write_text("parallel:\n  tp: 8  # mine\n")
    outcome = run_main("plan", "--model", "tiny", "--gpus", "2", "--output", str(block))
    assert_clean_refusal(outcome, f"--output {block} already exists; pass --overwrite to replace it")
    assert block.read_text() == "parallel:\n  tp: 8  # mine\n"
    assert run_main("plan", "--model", "tiny", "--gpus", "2", "--output", str(block), "--overwrite").status == 0
    assert "# mine" not in block.read_text() and "\nparallel:\n  num_workers: 2\n" in block.read_text()


def test_the_cli_refuses_part_of_a_node_beyond_the_first_and_names_gpu_memory():
    """A cluster is whole nodes: 12 GPUs of 8 per node would be a node and a half. Fewer GPUs than
    one node holds is one node, partly used."""
    outcome = run_main("plan", "--model", "1.3b", "--gpus", "12", "--gpus-per-node", "8")
    assert_clean_refusal(outcome, "--gpus 12 is not a whole number of nodes of --gpus-per-node 8")
    assert outcome.status == 2 and "e.g. 8 or 16" in outcome.stderr
    assert run_main("plan", "--model", "1.3b", "--gpus", "4", "--gpus-per-node", "8").status == 0
    for memory, message in (("0GB", "--gpu-memory 0GB is no memory"),
                            ("0", "--gpu-memory '0' is not a number with a unit: expected e.g. 80GB")):
        outcome = run_main("plan", "--model", "1.3b", "--gpus", "8", f"--gpu-memory={memory}")
        assert_clean_refusal(outcome, message)
        assert outcome.status == 2 and "gpu_memory_bytes" not in outcome.stderr


def test_young_daly_interval_maximises_goodput_and_plan_prints_it():
    from raylm.train.checkpoint.interval import Reliability, goodput, project, young_daly_interval_s

    r = Reliability(failures_per_day=0.6, save_s=20.0, restart_s=120.0)
    best = young_daly_interval_s(r.save_s, r.mtbf_s)
    assert best == pytest.approx((2 * 20 * 86400 / 0.6) ** 0.5)
    assert goodput(best, r) > max(goodput(best / 2, r), goodput(best * 2, r))
    # By hand: a 1 h interval, 20 s saves, a 2 min restart and a failure every 40 h.
    r = Reliability(failures_per_day=0.6, save_s=20.0, restart_s=120.0)
    assert goodput(3600, r) == pytest.approx(3600 / 3620 * (1 - (120 + 1810) / (40 * 3600)))
    # OPT-175B's checkpoint: 175B parameters × 12 bytes, over 124 nodes at 1 GB/s each.
    p = project(count_params(replace(ModelConfig(**preset("175b")), vocab_size=50272)), nodes=124, gbps_per_node=1.0,
                failures_per_day=35 / 60, restart_overhead_s=60)
    assert p.checkpoint_tb == pytest.approx(2.1, abs=0.01) and p.save_s == pytest.approx(p.checkpoint_tb * 1e12 / 124e9)
    outcome = run_main("plan", "--model", "175b", "--gpus", "992", "--failures-per-day", "0.5833")
    assert outcome.status == 0
    assert f"checkpoint every {p.interval_min:.0f} min (Young–Daly" in outcome.stdout
    assert f"expected goodput {p.goodput:.1%}" in outcome.stdout
    assert run_main("plan", "--model", "175b", "--gpus", "992", "--failures-per-day", "0").status == 2
