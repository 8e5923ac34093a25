"""The profiling callback's parts that do not need Lightning: step timing, statistics, the report."""
