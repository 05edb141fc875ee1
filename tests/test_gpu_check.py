"""benchmarks/gpu_check.py --cpu-tiny: the GPU check's whole code path, on CPU, in a process where
Ray, boto3 and botocore cannot be imported (the GPU machine has none of them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCKED = ("ray", "boto3", "botocore")


def _env_without_ray(tmp_path: Path) -> dict:
    """The environment of a Python whose `import ray` (boto3, botocore) fails, as on the GPU machine:
    a sitecustomize, first on PYTHONPATH, puts None in their sys.modules entries."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import sys\nfor name in {BLOCKED!r}:\n    sys.modules[name] = None\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def test_cpu_tiny_runs_every_section_without_ray_or_boto3(tmp_path):
    env = _env_without_ray(tmp_path)
    for name in BLOCKED:
        probe = subprocess.run([sys.executable, "-c", f"import {name}"], check=False, env=env, capture_output=True,
                               text=True)
        assert probe.returncode != 0 and "halted; None in sys.modules" in probe.stderr, name
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--cpu-tiny", "--json-out",
                           str(out)], check=False, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| section" in done.stdout  # the table
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert not [key for key, result in sections.items() if "error" in result]

    mfu = sections["mfu_eager"]
    assert mfu["tokens_per_s"] > 0 and 0 < mfu["mfu"] < 1 and mfu["flops_per_token"] > 0
    assert mfu["one_gpu"]["tokens_per_s"] > 0 and 0 < mfu["one_gpu"]["mfu"] < 1  # no FSDP2, bf16 autocast
    assert "skipped" in sections["mfu_compiled"]  # no compilation on CPU
    loop = sections["loop"]
    assert loop["tokens_per_s"] > 0 and loop["bare_tokens_per_s"] == mfu["tokens_per_s"]
    assert isinstance(loop["overhead"], float)
    # The loop reads the device every 10 steps: the steps between make no host sync, a read one.
    assert report["host_syncs_per_step"] == 0 == loop["syncs"]["host_syncs_per_step"]
    assert loop["syncs"]["steps_counted"] >= 5 and loop["syncs"]["host_syncs_per_read"] == 1
    resume = sections["resume"]
    assert resume["equal"] is True and resume["resumed_from_step"] == resume["stop_at_step"] > 0
    assert resume["max_rel_diff_after_resume"] == 0.0 and len(resume["losses_resumed"]) == resume["steps"]
    memory = sections["memory"]["rows"]
    assert [row["layout"] for row in memory] == ["FSDP2", "one-GPU"]
    assert all(row["estimate_gib"] > 0 and "skipped" in row for row in memory)
    # One GPU without FSDP2 keeps fp32 weights and optimizer state beside bf16 activations.
    assert memory[1]["estimate_parts_gib"]["params"] > memory[0]["estimate_parts_gib"]["params"]
    fp16 = sections["fp16"]
    assert fp16["losses_finite"] and fp16["growths"] + fp16["overflows"] > 0
    reference = sections["reference"]
    assert reference["params_raylm"] == reference["params_reference"]  # the same shape on both sides
    assert reference["raylm"]["tokens_per_s"] > 0 and reference["reference"]["tokens_per_s"] > 0
    assert reference["raylm_fsdp2"]["tokens_per_s"] > 0 and reference["ratio_fsdp2"] > 0
    float8 = sections["float8"]  # refused on a CPU, by name; bf16 trains on the standard library's text
    assert "train.precision=float8" in float8["float8"]["refused"] and "CPU" in float8["float8"]["refused"]
    assert len(float8["bf16"]["losses"]) == float8["steps"] and float8["bf16"]["losses"][-1] < float8["bf16"]["losses"][0]
