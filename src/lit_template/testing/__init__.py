"""Tools that tests, benchmarks and demos use; not part of a training run unless you add them.

- ``faults.FaultInjection``: a callback that makes one rank misbehave at one step (kill, hang, NaN, a signal, ...).
- ``bench``: the hand-written loop and timing callback the benchmark scripts compare the template with.
"""
