"""Dense bf16 peak FLOP/s per GPU model, from the vendors' data sheets (no sparsity): the MFU
denominator of a run and the planner's default rate.

A GPU is known by the exact name torch gives it (`torch.cuda.get_device_name`) and its count of
streaming multiprocessors: one family holds parts of different peaks (an H100 PCIe is 756
TFLOP/s, an H100 SXM 989; an L40S is not an L4), and a slice of a GPU (MIG) keeps the name with
fewer multiprocessors, its share of the peak. A name not in the table has no peak: MFU is then
left out of the metrics (train.peak_tflops gives one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class GPUModel:
    name: str  # as torch.cuda.get_device_name gives it
    multiprocessors: int
    bf16_flops: float  # dense


GPU_MODELS = {m.name.lower(): m for m in (
    GPUModel("NVIDIA H100 80GB HBM3", 132, 989e12),  # SXM5
    GPUModel("NVIDIA H100 PCIe", 114, 756e12),
    GPUModel("NVIDIA H100 NVL", 132, 835e12),
    GPUModel("NVIDIA H200", 132, 989e12),  # SXM
    GPUModel("NVIDIA H200 NVL", 132, 835e12),
    GPUModel("NVIDIA GH200 480GB", 132, 989e12),
    GPUModel("NVIDIA B200", 148, 2250e12),
    GPUModel("NVIDIA A100-SXM4-80GB", 108, 312e12),
    GPUModel("NVIDIA A100-SXM4-40GB", 108, 312e12),
    GPUModel("NVIDIA A100 80GB PCIe", 108, 312e12),
    GPUModel("NVIDIA A100-PCIE-40GB", 108, 312e12),
    GPUModel("NVIDIA A10", 72, 125e12),
    GPUModel("NVIDIA L4", 58, 121e12),
    GPUModel("NVIDIA L40S", 142, 362e12),
    GPUModel("NVIDIA L40", 142, 181e12),
    GPUModel("NVIDIA GeForce RTX 4090", 128, 165e12),
    GPUModel("Tesla V100-SXM2-16GB", 80, 125e12),  # fp16: a V100 has no bf16 units
    GPUModel("Tesla V100-SXM2-32GB", 80, 125e12),
)}
A100_FLOPS = GPU_MODELS["nvidia a100-sxm4-80gb"].bf16_flops  # the planner's default node


def gpu_peak_flops(name: str, multiprocessors: int) -> Optional[float]:
    """The dense bf16 peak of the GPU torch names `name` with `multiprocessors` SMs (a MIG slice:
    its share), or None for a model not in the table. A MIG slice's name carries its profile
    after the model's ("NVIDIA H100 80GB HBM3 MIG 1g.10gb")."""
    key = " ".join(name.split()).lower()
    model = GPU_MODELS.get(key) or GPU_MODELS.get(key.split(" mig ")[0])
    if model is None:
        return None
    return model.bf16_flops * min(1.0, multiprocessors / model.multiprocessors)
