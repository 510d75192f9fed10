"""The runtime without a model: a synthetic workload generator (``k3-trt bench``) and an
executor that checks step metadata instead of doing math (runtime tests, bench_runner)."""
