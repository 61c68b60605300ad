"""Results over commits: the benchmark history, the regression gate, the dashboard.

- `bench`: ``twinpipe bench``: pytest-benchmark runs and compare reports kept as history
  entries stamped with commit, date and machine;
- `documents`: what a file is (a compare report, a history entry, pytest-benchmark JSON),
  whether its sections have the shapes their readers need, the device its figures come
  from, and the history folder's entries (a bad file skipped with a warning);
- `diff`: ``twinpipe diff``: two documents of one kind, every regression in words;
- `diff_judge`: the rule for one figure (growth past a tolerance regresses, a figure
  that went missing regresses) and the result it adds to;
- `dashboard`: ``twinpipe dashboard``: the static page and its command;
- `dashboard_data`: the history as series (each op against its plain counterpart, each
  compare run's agreement and memory);
- `dashboard_plots`: those series drawn over commits (matplotlib);
- `dashboard_tables`: the page's tables and cell formats (a speed-up measured through
  Triton's interpreter is marked, not coloured);
- `dashboard_training`: the training view, `twinpipe train` metrics files (``--training``)
  drawn as training and validation loss over steps;
- `results`: the measured-results file (``docs/results.json``): its checks, the Markdown page
  generated from it and the dashboard's table of it.

May import `harness.report` and `models`; never `harness.compare`, `harness.memory`,
`optimized` or `reference`: the history is read where no stack runs.
"""
