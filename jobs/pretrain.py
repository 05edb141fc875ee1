"""Pretraining as a Ray job: the arguments of `raylm train` (a config and dotted overrides).

    ray job submit --address http://127.0.0.1:8265 --runtime-env jobs/runtime_env.yaml \
        --submission-id raylm-demo-1 -- python jobs/pretrain.py configs/demo-cpu.yaml train.steps=100

Inside a job, Ray sets RAY_ADDRESS for this process, so raylm joins the job's cluster instead
of starting one. Resubmitting a stopped or failed run (a new submission id, the same run.name
and storage) resumes it from its newest complete checkpoint.
"""

import sys

from raylm.cli import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])
