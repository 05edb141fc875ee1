"""A scaling-law sweep as a Ray job: the arguments of `raylm sweep` (a sweep config and overrides).

    ray job submit --address http://127.0.0.1:8265 --runtime-env jobs/runtime_env.yaml \
        -- python jobs/sweep.py configs/sweep-cpu.yaml run.storage_path=/shared/runs

Inside a job, Ray sets RAY_ADDRESS, so the sweep's trials run on the job's cluster. The sweep
directory must be on storage every node sees; resubmitting the same command resumes the sweep.
"""

import sys

from raylm.cli import main

if __name__ == "__main__":
    main(["sweep", *sys.argv[1:]])
