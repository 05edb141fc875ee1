"""What keeps a run going without a human: the stability guard (`guard`) and its stop
(`guard_stop`), the progress watchdog (`watchdog`), each worker's self-test and the straggler
report (`health`)."""
