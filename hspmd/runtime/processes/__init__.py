"""Real processes: the `hspmd run` launcher, the guard each rank runs under, the membership
authority of an elastic job, run_multiprocess for tests, ports and CPU affinity."""
