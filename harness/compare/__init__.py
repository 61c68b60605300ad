"""`twinpipe compare` from plan to verdict."""
