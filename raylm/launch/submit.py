"""`raylm submit`: a training run as a Ray job on a cluster, followed to its end.

    raylm submit configs/demo-cpu.yaml train.steps=100 --address http://127.0.0.1:8265

It submits what `ray job submit` would, with the same runtime environment
(jobs/runtime_env.yaml):

    ray job submit --address URL --runtime-env jobs/runtime_env.yaml \
        --submission-id raylm-<run.name>-<attempt> -- python jobs/pretrain.py CONFIG OVERRIDES

and adds: the config is checked here before anything is submitted; the submission id is
derived from the run name, the attempt one past the run's earlier jobs (Ray refuses to reuse
an id), so a resubmitted run resumes from its newest checkpoint under its own name; a second
job for a run whose job is still active is refused; logs are followed and the exit status is
the job's (0 only for SUCCEEDED; a failed job's driver's own status, 2 for bad input). The
job's status is polled as the truth: following the logs can end before the job does
(ray-project/ray#51601).
"""

from __future__ import annotations

import asyncio
import http.client
import os
import re
import shlex
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterable, Optional

import yaml

from raylm.config import Config, ConfigError, load_config
from raylm.data.storage import is_s3

RUNTIME_ENV_FILE = Path("jobs") / "runtime_env.yaml"
PRETRAIN_ENTRYPOINT = "jobs/pretrain.py"
# Names that carry credentials: the job server stores a runtime env and the dashboard shows it.
_SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|CREDENTIAL|PRIVATE|ACCESS_KEY", re.IGNORECASE)


class SubmitError(Exception):
    """The job could not be submitted or followed; the message says why and what to do."""


def check_job_config(cfg: Config) -> None:
    """A job runs in a temporary copy of the working directory on a cluster node: a relative
    local path would point into that copy, so data would not be found and a run's checkpoints
    would vanish with the job (and a resubmission could not resume it)."""
    paths = [("run.storage_path", cfg.run.storage_path), ("data.path", cfg.data.path)]
    paths += [(f"data.mixture[{i}].path", c.path) for i, c in enumerate(cfg.data.mixture)]
    for name, value in paths:
        if value and not is_s3(value) and not os.path.isabs(value):
            raise ConfigError(
                f"{name}={value!r} is a relative path: inside a Ray job it points into the job's temporary "
                "copy of the working directory (without runs/ and data/, deleted when the job ends). Give "
                "an s3:// URI or an absolute path on storage that every node shares")


def job_id_prefix(run_name: str) -> str:
    return "raylm-" + re.sub(r"[^A-Za-z0-9._-]", "-", run_name) + "-"


def next_submission_id(run_name: str, jobs: Iterable) -> str:
    """`raylm-<run name>-<attempt>`: one past the run's earlier attempts. Raises SubmitError if
    one of them is still pending or running: two jobs would write the same run directory."""
    prefix, attempts = job_id_prefix(run_name), [0]
    for job in jobs:
        suffix = (job.submission_id or "")[len(prefix):]
        if (job.submission_id or "").startswith(prefix) and suffix.isdigit():
            if not job.status.is_terminal():
                raise SubmitError(f"run {run_name!r} already has job {job.submission_id} {job.status.value}: "
                                  f"a second job would write the same run directory; wait for it or stop it "
                                  f"(ray job stop {job.submission_id})")
            attempts.append(int(suffix))
    return f"{prefix}{max(attempts) + 1}"


def load_runtime_env(root: Path, env: Optional[dict[str, str]] = None) -> dict:
    """jobs/runtime_env.yaml with its working_dir made absolute and `env` added to env_vars."""
    path = root / RUNTIME_ENV_FILE
    if not path.is_file():
        raise SubmitError(f"{path} not found: run `raylm submit` from the root of a raylm checkout "
                          "(the job uploads it as its working directory)")
    runtime_env = yaml.safe_load(path.read_text()) or {}
    runtime_env["working_dir"] = str((root / runtime_env.get("working_dir", ".")).resolve())
    for name in env or {}:
        if _SECRET_NAME.search(name):
            raise SubmitError(f"--env {name}: credentials must not go into a job's runtime env (the job server "
                              "stores it and the dashboard shows it); give them to the cluster's nodes "
                              "(instance role, Kubernetes secret)")
    runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **(env or {})}
    return runtime_env


def _job_server_answers(address: str, source: str) -> None:
    """Refuse a job server that does not answer within HANDSHAKE_S, as Ray's job client sets no
    timeout on its first request. Any HTTP answer will do (401 without this user's token); a
    refused connection, or something that is not HTTP, is left to Ray's client, which names it
    within seconds."""
    from raylm.ray_runtime import HANDSHAKE_S

    try:
        urllib.request.urlopen(f"{address.rstrip('/')}/api/version", timeout=HANDSHAKE_S).close()
        return
    except urllib.error.URLError as e:  # HTTPError too, whose reason is its status line
        timed_out = isinstance(e.reason, TimeoutError)
    except TimeoutError:
        timed_out = True
    except (OSError, http.client.HTTPException):
        timed_out = False
    if timed_out:
        raise SubmitError(f"cannot reach the Ray job server at {source}={address}: nothing answered within "
                          f"{HANDSHAKE_S:.0f} s (a head that hangs, or a forwarded port whose far end is gone)")


def _client(address: Optional[str]):
    from ray.job_submission import JobSubmissionClient

    from raylm.ray_runtime import RayJoinError, check_answers, ensure_auth_token

    source = "--address"
    if address:
        # Ray's client prefers these variables over the address it is given; an explicit
        # --address wins here.
        os.environ.pop("RAY_API_SERVER_ADDRESS", None)
        os.environ.pop("RAY_ADDRESS", None)
    else:
        source = "RAY_API_SERVER_ADDRESS" if os.environ.get("RAY_API_SERVER_ADDRESS") else "RAY_ADDRESS"
        address = os.environ.get(source)
    if not address:
        raise SubmitError("no job server address: pass --address http://HOST:8265 (the head's dashboard, e.g. "
                          "through `ray dashboard cluster/aws-a100.yaml` or `kubectl port-forward`)")
    if address.startswith(("http://", "https://")):
        _job_server_answers(address, source)
    else:  # a GCS address: Ray's client asks the GCS where the job server is
        try:
            check_answers(address, source, local_start=None)
        except RayJoinError as e:
            raise SubmitError(str(e)) from None
    ensure_auth_token()  # the client sends this user's token (a cluster's must be copied here)
    try:
        return JobSubmissionClient(address), address
    except Exception as e:  # noqa: BLE001 - connection, auth and version errors all mean "not reachable"
        raise SubmitError(f"cannot reach the Ray job server at {address}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''} (is the cluster up, its dashboard port "
                          "forwarded, and this user's Ray token the cluster's?)") from None


def submit(config: str, overrides: list[str], address: Optional[str], wait: bool = True,
           env: Optional[dict[str, str]] = None) -> int:
    """Check, submit and (with `wait`) follow a pretraining job; returns the exit status."""
    root = Path.cwd()
    cfg = load_config(config, overrides)  # an unknown key or bad value fails here, before submitting
    check_job_config(cfg)
    config_path = Path(config).resolve()
    if not config_path.is_relative_to(root):
        raise SubmitError(f"{config} is outside {root}, the working directory the job uploads: "
                          "put the config under it")
    runtime_env = load_runtime_env(root, env)
    client, address = _client(address)
    job_id = next_submission_id(cfg.run.name, client.list_jobs())
    entrypoint = shlex.join(["python", PRETRAIN_ENTRYPOINT, str(config_path.relative_to(root)), *overrides])
    client.submit_job(entrypoint=entrypoint, submission_id=job_id, runtime_env=runtime_env,
                      metadata={"raylm_run": cfg.run.name})
    print(f"raylm: submitted {job_id}: {entrypoint}\n"
          f"raylm: logs: ray job logs --follow {job_id} --address {address}; "
          f"stop: ray job stop {job_id} --address {address}", flush=True)
    if not wait:
        return 0
    try:
        status = follow(client, job_id)
    except KeyboardInterrupt:
        print(f"\nraylm: stopped following; {job_id} keeps running (ray job stop {job_id} --address {address})",
              file=sys.stderr)
        return 130
    if status.value != "SUCCEEDED":
        info = client.get_job_info(job_id)
        print(f"raylm: error: job {job_id} {status.value}: {info.message}", file=sys.stderr)
        # The driver's own status where it exited with one: 2 tells a script that the input is
        # wrong and a resubmission would fail the same way. A stop or a killed driver gives 1.
        code = info.driver_exit_code
        return code if code is not None and 0 < code < 256 else 1
    print(f"raylm: job {job_id} SUCCEEDED")
    return 0


def follow(client, job_id: str, poll_s: float = 1.0, drain_s: float = 5.0):
    """Print the job's logs as they come until its status is terminal; returns that status.
    Whatever the log stream missed is printed from the full log at the end."""
    printed = 0

    async def tail() -> None:
        nonlocal printed
        async for chunk in client.tail_job_logs(job_id):
            print(chunk, end="", flush=True)
            printed += len(chunk)

    async def run():
        logs = asyncio.create_task(tail())
        while not (status := await asyncio.to_thread(client.get_job_status, job_id)).is_terminal():
            await asyncio.sleep(poll_s)
        try:
            await asyncio.wait_for(logs, timeout=drain_s)  # cancels the stream after drain_s
        except Exception:  # noqa: BLE001 - a stream cut short or late: the full log is printed below
            pass
        return status

    status = asyncio.run(run())
    print(client.get_job_logs(job_id)[printed:], end="", flush=True)
    return status
