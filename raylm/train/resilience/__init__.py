"""What keeps a run going without a human: the stability guard (`guard`, its decisions as the
loop's actions in `decisions`, its `snapshot`s and its stop in `guard_stop`), the progress watchdog
(`watchdog`), each worker's self-test and the straggler report (`health`)."""
