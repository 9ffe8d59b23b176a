"""Evaluation: the benchmark question sets, the methods compared (ours, plain decoding and the two peers),
timed runs with every output checked against plain decoding, their summaries and charts, and speedups
projected from trajectories priced with a device's cost profile."""
