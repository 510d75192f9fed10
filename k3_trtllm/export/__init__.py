"""``k3-trt build``'s export side: the torch model as one ONNX step graph whose K3 ops are
``k3``-domain plugin nodes (schemas and translations generated from ``ops/contract.py``),
its checks, its CPU execution, and the engine dir it goes into."""
