"""The one step executor: every forward of a request slot, traced, captured and replayed."""
