"""asyncrl's benchmarks: one module per benchmark, each run from the repository root as
`python bench/NAME.py` or `asyncrl bench NAME` (which runs `python -m bench.NAME`), writing its
figures to bench/results/.

`common` holds what every benchmark shares (the timed loop of warm-up and repetitions, the
median/min/max of its samples, the JSON record with machine, library versions and commit, and
the machine's own measurements); `cpu_sampler` samples a run's processes' CPU time; `sim` is the
cluster-scale simulator that bench/simulate.py drives.
"""
