"""`raylm plan`: per-GPU memory and communication of a layout (`memory`), and every feasible
layout of a model on a cluster, ranked (`plan`)."""
