"""edgeline's export side: torch model in, verified bundle out. Needs the `export` extra to run."""
