"""tandem's common library: the engine, the wire schema, configuration and logging."""
