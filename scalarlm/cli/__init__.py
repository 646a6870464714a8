"""The `scalarlm` command line: serve, generate, make-tiny-model."""
