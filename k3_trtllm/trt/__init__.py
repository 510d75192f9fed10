"""TensorRT side of ``k3-trt build`` and run: the bindings (TensorRT or TensorRT-RTX),
plan building through the ONNX parser, and the executor that binds an engine's I/O."""
