"""Models: loading a target / middle pair (any hub id or local folder, and the embedded default pair), the
causal-LM wrapper every pass goes through, and the CPU kernels and precisions those passes run in."""
