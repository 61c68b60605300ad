"""The harness: runs the two stacks side by side and keeps what they measured, in four
subpackages whose imports point one way (each names its modules and what it may import in
its ``__init__``; ``tests/test_structure.py`` holds every import to those edges):

- `harness.compare`: ``twinpipe compare`` from plan to verdict;
- `harness.memory`: the per-rank peak-memory tracker, its CPU and CUDA backends;
- `harness.report`: the compare report's schema, formatting, rendering, plots, provenance;
- `harness.history`: results over commits: ``bench``, ``diff``, the dashboard.

``compare -> memory, report`` and ``history -> report``; `memory` and `report` import no
other subpackage. `harness.cli` is the ``twinpipe`` command, one module per subcommand,
imported only when it runs.
"""
