"""Dataset preparation as a Ray job: the arguments of `raylm prepare`.

    ray job submit --address http://127.0.0.1:8265 --runtime-env jobs/runtime_env.yaml \
        -- python jobs/prepare.py --input s3://bucket/text --output s3://bucket/data/byte-256 --seq-len 256

Inside a job, Ray sets RAY_ADDRESS for this process, so the Ray Data pipeline runs on the
job's cluster.
"""

import sys

from raylm.cli import main

if __name__ == "__main__":
    main(["prepare", *sys.argv[1:]])
