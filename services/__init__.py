"""tandem's services and command line."""
