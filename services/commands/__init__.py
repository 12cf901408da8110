"""The `tandem` command line: its entry point and the tools that are not services."""
