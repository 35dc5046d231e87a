"""`kc`: the command line, one module per command group."""
