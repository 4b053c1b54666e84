"""What every benchmark uses: a job in a fresh process, the machine's description and load, the
models, workloads and states, the baselines and the side-by-side runner, the memory and timing
figures."""
