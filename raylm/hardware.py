"""Dense bf16 peak FLOP/s per GPU, from the vendors' data sheets (no sparsity): the MFU
denominator of a run and the planner's default rate."""

GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "A10G": 125e12, "L4": 121e12,
                  "V100": 125e12, "4090": 165e12}
