"""Hugging Face export as a Ray job: the arguments of `raylm export`.

    ray job submit --address http://127.0.0.1:8265 --runtime-env jobs/runtime_env.yaml \
        -- python jobs/export.py s3://bucket/runs/opt-1.3b --output s3://bucket/hf/opt-1.3b --dtype bf16

The export runs in the job's driver process: it reads the checkpoint one tensor at a time, so
the head node needs memory for the largest tensor, not for the model.
"""

import sys

from raylm.cli import main

if __name__ == "__main__":
    main(["export", *sys.argv[1:]])
