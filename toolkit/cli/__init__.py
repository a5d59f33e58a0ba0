"""ft's command line: thin typer commands over the library; the work happens elsewhere."""
