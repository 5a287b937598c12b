"""The verifier's serving engine (docs/architecture.md §6): the judge and sampler of a step (`ciar.engine.judge`)."""
