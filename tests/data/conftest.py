"""tests/data holds inputs for the tests, not tests: a normal test run skips it.

``bench_sample/`` is a tiny benchmark suite for `twinpipe bench`, which collects
it explicitly with ``--benchmarks tests/data/bench_sample``.
"""

collect_ignore = ["bench_sample"]
