"""Results over commits: `bench`, `diff` and its judge, the dashboard."""
