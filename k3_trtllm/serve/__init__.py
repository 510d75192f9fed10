"""Serving k3-trt behind Triton Inference Server: a decoupled Python-backend model that
owns one inflight-batching engine (triton_model), the model repository that loads it
(repository), and the launcher of the tritonserver bundled in nvidia-pytriton (server).

Nothing here imports Triton at package import; triton_model only loads inside Triton."""
