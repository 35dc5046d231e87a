"""Planning: the auto-parallel cost model and `parallel: auto` at submission."""
