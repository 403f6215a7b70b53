"""Command-line tools and test helpers built on the library: the benchmark (`moe-ops-bench`),
the tuner (`moe-ops-tune`), the compile check and the op counter. Nothing in the library imports
this package."""
