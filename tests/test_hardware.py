"""MFU's denominator: a GPU known by its exact model (name and multiprocessor count), not by a
substring of its name; a slice of one (MIG) by its share; an unknown one by none."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raylm.hardware import gpu_peak_flops
from raylm.train.observe.metrics import peak_flops


@pytest.mark.parametrize("name, sms, tflops", [
    ("NVIDIA H100 80GB HBM3", 132, 989),  # SXM
    ("NVIDIA H100 PCIe", 114, 756),  # once taken for an SXM: "H100" in its name
    ("NVIDIA H100 NVL", 132, 835),
    ("NVIDIA H200", 132, 989),
    ("NVIDIA L4", 58, 121),
    ("NVIDIA L40S", 142, 362),  # once taken for an L4 ("L4" in its name): MFU 3x too high
    ("NVIDIA A100-SXM4-40GB", 108, 312),
    ("NVIDIA A100 80GB PCIe", 108, 312),
])
def test_each_model_has_its_own_peak(name, sms, tflops):
    assert gpu_peak_flops(name, sms) == pytest.approx(tflops * 1e12)


def test_a_mig_slice_has_its_share_and_an_unknown_gpu_none():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3 MIG 1g.10gb", 16) == pytest.approx(989e12 * 16 / 132)
    assert gpu_peak_flops("NVIDIA RTX PRO 6000 Blackwell Server Edition", 188) is None
    assert gpu_peak_flops("NVIDIA H100", 132) is None  # not a name torch gives a known part


def test_the_run_reads_the_device_and_train_peak_tflops_wins(monkeypatch):
    props = SimpleNamespace(name="NVIDIA H100 PCIe", multi_processor_count=114)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    cuda = torch.device("cuda", 0)
    assert peak_flops(cuda) == pytest.approx(756e12)
    assert peak_flops(cuda, override_tflops=700) == pytest.approx(700e12)
    props.name = "Some Future GPU"
    assert peak_flops(cuda) is None  # MFU left out, never an error Ray's restart loop would retry
